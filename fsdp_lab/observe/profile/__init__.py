"""profile=trace: where each step's time goes, read from torch.profiler's traces.

``result`` holds what an analysis finds (dataclasses, and run.json's ``profile`` section);
``intervals`` the interval arithmetic; ``timeline`` turns a Chrome trace into device-neutral
intervals (compute, collectives with their FSDP unit, host regions); ``analysis`` measures them.
"""
