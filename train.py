"""Train a Hugging Face model with FSDP2, configured by Hydra.

    python train.py                                          # tiny Llama, 2 CPU ranks (or all GPUs)
    python train.py sharding=hybrid precision=bf16 hardware.nproc_per_node=4
    python train.py -m sharding=full,grad_op precision=fp32,bf16      # a local sweep: a failed
                                                                       # job is recorded, others run
    torchrun --nproc_per_node=2 train.py sharding=grad_op              # join torchrun's group
    python train.py --config-dir my_experiments/conf model=my_model   # a user's own options
    python train.py --cfg job                                # print the composed config

The same command, installed: ``fsdp-lab train ...`` or ``python -m fsdp_lab ...`` from any
directory (``fsdp_lab.launch.command``). Groups: sharding, precision, wrap, offload, hardware,
model, data, optim, loss, trainer, checkpoint, activation_checkpointing, logger, experiment
(see conf/, a link to fsdp_lab/conf). Each run writes outputs/<date>/<time>/: config.yaml,
run.json, metrics.jsonl, logs/rank*.log, and each tracker's files (wandb/, tensorboard/); a
sweep also writes report.md and plots in its multirun dir.
"""

import sys

from fsdp_lab.launch.command import main

if __name__ == "__main__":
    sys.exit(main())
