"""Train a Hugging Face model with FSDP2, configured by Hydra.

    python train.py                                          # tiny Llama, 2 CPU ranks (or all GPUs)
    python train.py sharding=hybrid precision=bf16 hardware.nproc_per_node=4
    python train.py -m sharding=full,grad_op precision=fp32,bf16      # a local sweep: a failed
                                                                       # job is recorded, others run
    torchrun --nproc_per_node=2 train.py sharding=grad_op              # join torchrun's group
    python train.py --cfg job                                # print the composed config

Groups: sharding, precision, wrap, offload, hardware, model, data, optim, loss, trainer,
checkpoint, activation_checkpointing, logger, experiment (see conf/).
Each run writes outputs/<date>/<time>/: config.yaml, run.json, metrics.jsonl, logs/rank*.log,
and each tracker's files (wandb/, tensorboard/); a sweep also writes report.md and plots in its
multirun dir.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fsdp_lab import config
from fsdp_lab.launch import sweep

config.register_schema()


def main() -> int:
    """Run the job (or each job of a -m sweep); the exit code: 1 if a sweep job failed (each
    failure is recorded in its run.json and listed at the end)."""
    jobs = sweep.SweepJobs()

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def one_job(cfg: DictConfig) -> float | None:
        hc = HydraConfig.get()
        return jobs.run_job(
            cfg,
            run_dir=Path(hc.runtime.output_dir),
            multirun=hc.mode == RunMode.MULTIRUN,
            job=sweep.job_info(hc),
            trial=hc.mode == RunMode.MULTIRUN and sweep.is_study(hc),
        )

    one_job()  # Hydra composes each job's config and calls one_job with it
    return jobs.exit_code()


if __name__ == "__main__":
    sys.exit(main())
