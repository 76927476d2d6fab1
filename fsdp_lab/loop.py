"""The training step and loop: plain PyTorch on an FSDP2 model."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_lab import hardware
from fsdp_lab.data import IGNORE_INDEX
from fsdp_lab.metrics import StepMetrics, StepTimer, gather_step_stats

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    local_loss: float  # this rank's mean loss over its micro-batches
    grad_norm: float  # global norm over all ranks' shards, before clipping
    skipped: bool  # the grad scaler found inf/nan and skipped the update


def train_step(model: nn.Module, batches: list[dict[str, torch.Tensor]], *,
               optimizer: torch.optim.Optimizer, scaler, grad_clip: float | None) -> StepResult:
    """Forward/backward over the micro-batches, one gradient reduction, clip, update."""
    num_micro = len(batches)
    device = batches[0]["input_ids"].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    # FSDP2: reduce-scatter only after the last micro-batch; earlier ones accumulate locally.
    # (On XLA the compiler places the reductions in the step's one graph.)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    for i, batch in enumerate(batches):
        if set_sync is not None:
            set_sync(i == num_micro - 1)
        loss = model(**batch).loss / num_micro
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach().float()
    if scaler is not None:
        scaler.unscale_(optimizer)  # so clipping sees true gradient magnitudes
    norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm=grad_clip if grad_clip is not None else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    skipped = False
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale  # the scale backs off exactly when a step is skipped
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    hardware.mark_step(device)  # XLA: the step's graph runs here, before its numbers are read
    return StepResult(local_loss=total.item(), grad_norm=norm.item(), skipped=skipped)


def train(model: nn.Module, *, data, optimizer, scheduler, scaler, grad_clip: float | None,
          start_step: int, max_steps: int, grad_accum_steps: int, tokens_per_step: int,
          device: torch.device, on_step, stop_requested,
          place) -> tuple[StepMetrics | None, bool]:
    """Run optimizer steps start_step+1..max_steps, calling ``on_step(metrics)`` on every rank.
    ``place`` puts this process's rows of a micro-batch on its device(s).

    Returns the last step's metrics and whether the run stopped early because some rank's
    ``stop_requested()`` said so (a preemption signal); all ranks stop after the same step.
    """
    model.train()
    timer = StepTimer(device)
    last = None
    loop_start = time.perf_counter()
    for step in range(start_step, max_steps):
        timer.start()
        batches = [place(data.batch(step, m)) for m in range(grad_accum_steps)]
        lr = scheduler.get_last_lr()[0]
        result = train_step(model, batches, optimizer=optimizer, scaler=scaler,
                            grad_clip=grad_clip)
        scheduler.step()
        step_time = timer.stop()
        loss, peaks, stop = gather_step_stats(result.local_loss, device,
                                              stop_requested=stop_requested())
        if not math.isfinite(loss) and scaler is None:
            raise FloatingPointError(
                f"loss is {loss} at step {step + 1}; lower optim.lr or use precision=fp32/bf16")
        last = StepMetrics(step=step + 1, loss=loss, grad_norm=result.grad_norm, lr=lr,
                           step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                           peak_mem_bytes=max(peaks), peak_mem_bytes_per_rank=peaks,
                           skipped=result.skipped, elapsed_s=time.perf_counter() - loop_start)
        on_step(last)
        if stop and step + 1 < max_steps:
            return last, True
    return last, False


@dataclass
class EvalResult:
    loss: float  # mean over every predicted validation token of every rank
    perplexity: float
    tokens: int
    time_s: float


@torch.no_grad()
def evaluate(model: nn.Module, data, *, num_batches: int, causal: bool,
             device: torch.device, place) -> EvalResult:
    """Validation loss over ``num_batches`` micro-batches per rank (every rank runs the same
    number: each forward is a collective). Sums of token losses and counts are all-reduced, so
    the mean is over tokens, whatever rows a rank got or how many positions a mask chose."""
    start = time.perf_counter()
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for index in range(num_batches):
        batch = place(data.val_batch(index))
        logits = model(input_ids=batch["input_ids"]).logits.float()
        labels = batch["labels"]
        if causal:  # position t predicts token t+1
            logits, labels = logits[:, :-1], labels[:, 1:]
        sums[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum").double()
        sums[1] += (labels != IGNORE_INDEX).sum()
        hardware.mark_step(device)
    sums = sums.to(hardware.collective_device(device))
    dist.all_reduce(sums)
    model.train()
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=int(sums[1]),
                      time_s=time.perf_counter() - start)
