"""How a model runs on the hardware: the device, wrap units, precision, activation checkpointing,
model building, and the two engines that shard (FSDP2, torch_xla SPMD). Imports config only.
"""
