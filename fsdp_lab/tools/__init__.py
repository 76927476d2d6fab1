"""The ``fsdp-lab`` commands (``tools.cli``): train, plan, tune, calibrate, report, profile,
export, verify, from-accelerate, data, eval. What plan, tune and calibrate compute is
``fsdp_lab.planning``'s; the commands parse, print and exit. Imports any package."""
