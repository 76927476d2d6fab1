"""Timing on a rank, robustly: a figure is a statistic over repeated short samples, taken
until its 95% confidence interval is within a target of it or its time budget is spent. A
busy machine costs more samples and a wider interval, stated beside the figure; it is never a
refusal. The median for what runs alone (a kernel); the mean for what a step sums many of
and whose rare long waits count in full (a collective).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_lab.engine.hardware import devices, process_group

Z95 = 1.96  # the normal quantile of a two-sided 95% interval


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median of the samples and its 95% confidence interval."""

    median: float
    low: float
    high: float
    samples: int

    @property
    def spread(self) -> float:
        """The interval's half-width relative to the median (0.03: +-3%)."""
        return (self.high - self.low) / 2 / self.median if self.median > 0 else math.inf

    def to_json(self) -> list[float]:
        return [self.median, self.low, self.high, self.samples]

    @classmethod
    def from_json(cls, v) -> Timing:
        return cls(v[0], v[1], v[2], int(v[3]))


def median_interval(xs: list[float]) -> Timing:
    """The median and its distribution-free 95% interval: the order statistics j and k with
    j, k = n/2 -+ 1.96 sqrt(n)/2 (a binomial(n, 1/2) count of samples below the median)."""
    v = sorted(xs)
    n = len(v)
    half = Z95 * math.sqrt(n) / 2
    j = max(0, math.floor(n / 2 - half))
    k = min(n - 1, math.ceil(n / 2 + half) - 1)
    return Timing(statistics.median(v), v[j], v[k], n)


def mean_interval(xs: list[float]) -> Timing:
    """The mean and its 95% interval (1.96 standard errors): for what a step sums many of,
    whose rare long waits count in full (a collective's)."""
    n = len(xs)
    mean = statistics.fmean(xs)
    half = Z95 * statistics.stdev(xs) / math.sqrt(n) if n > 1 else math.inf
    return Timing(mean, mean - half, mean + half, n)


@dataclass(frozen=True)
class Budget:
    """How long one measurement may take and how tight its interval should be."""

    seconds: float = 0.3
    target: float = 0.02  # the interval's relative half-width at which it stops
    min_samples: int = 7
    sample_s: float = 0.01  # one sample: this long a batch of calls


def _calls(fn: Callable[[], None], device: torch.device, sample_s: float) -> int:
    """Calls per sample so that one sample lasts about ``sample_s`` (after a warm-up call)."""
    fn()
    devices.synchronize(device)
    start = time.perf_counter()
    fn()
    devices.synchronize(device)
    once = time.perf_counter() - start
    return max(1, min(10_000, int(sample_s / max(once, 1e-7))))


def _sample(fn: Callable[[], None], device: torch.device, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    devices.synchronize(device)
    return (time.perf_counter() - start) / calls


def time_it(fn: Callable[[], None], device: torch.device, budget: Budget) -> Timing:
    """``fn``'s seconds per call on this rank alone (no collective)."""
    calls = _calls(fn, device, budget.sample_s)
    start, xs = time.perf_counter(), []
    while True:
        xs.append(_sample(fn, device, calls))
        if len(xs) >= budget.min_samples:
            t = median_interval(xs)
            if t.spread <= budget.target or time.perf_counter() - start > budget.seconds:
                return t


def time_together(
    fn: Callable[[], None],
    device: torch.device,
    budget: Budget,
    statistic: Callable[[list[float]], Timing] = mean_interval,
) -> Timing:
    """``fn``'s seconds per call where ``fn`` is a collective: every rank takes as many
    samples of as many calls (the most any rank chose; it stops when every rank's interval
    is tight enough or any rank's budget is spent). ``statistic``: the mean (a collective's
    cost that a step sums), or the median (a whole step's, as a run reports its step)."""
    where = process_group.collective_device(device)
    calls = torch.tensor([_calls(fn, device, budget.sample_s)], device=where)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    n = int(calls.item())
    start, xs = time.perf_counter(), []
    while True:
        dist.barrier()
        xs.append(_sample(fn, device, n))
        t = statistic(xs)
        if len(xs) < budget.min_samples:
            continue
        more = t.spread > budget.target and time.perf_counter() - start <= budget.seconds
        flag = torch.tensor([float(more), float(time.perf_counter() - start > budget.seconds)],
                            device=where)  # fmt: skip
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag[0].item() or flag[1].item():
            return t
