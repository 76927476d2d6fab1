"""From a composed config to N ranks: local spawn, torchrun or srun, sweeps, SLURM. Imports the
packages above.
"""
