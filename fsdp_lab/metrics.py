"""Per-step measurements: step time, throughput, peak memory, all reduced over ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_lab import hardware


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    peak_mem_bytes: int
    peak_mem_bytes_per_rank: list[int]
    skipped: bool = False
    elapsed_s: float = 0.0  # wall time since the loop started, all overheads included

    def as_record(self) -> dict:
        return dict(self.__dict__)


class StepTimer:
    """Wall time of one optimizer step, with the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = 0.0

    def start(self) -> None:
        hardware.synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        hardware.synchronize(self.device)
        return time.perf_counter() - self._start


def gather_step_stats(local_loss: float, device: torch.device, *,
                      stop_requested: bool) -> tuple[float, list[int], bool]:
    """(mean loss over ranks, each rank's peak memory, whether any rank asked to stop) in one
    small all-reduce per step.

    Every rank's micro-batches hold the same number of tokens, so the mean of the ranks' mean
    losses is the mean loss of the global batch. A stop request (a signal) may reach the ranks
    at different steps; sharing it here makes every rank stop after the same step.
    """
    # One-hot rows summed by all-reduce: works on every backend and torch version
    # (all_gather_into_tensor is deprecated in recent releases).
    stats = torch.zeros(dist.get_world_size(), 3, dtype=torch.float64, device=device)
    stats[dist.get_rank()] = torch.tensor(
        [local_loss, float(hardware.peak_memory_bytes(device)), float(stop_requested)],
        dtype=torch.float64)
    dist.all_reduce(stats)
    rows = stats.cpu()
    return (rows[:, 0].mean().item(), [int(v) for v in rows[:, 1].tolist()],
            bool(rows[:, 2].sum().item() > 0))
