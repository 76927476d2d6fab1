"""The training step and loop: plain PyTorch on an FSDP2 model, with no host sync in the step.

Between logging boundaries (``trainer.log_every`` steps, evaluations, checkpoints, the last
step) nothing waits for the device: the step's loss, gradient norm and skip flag stay device
tensors and ``metrics.StepWindow`` reads a whole window of them at the boundary. So the host runs
ahead of the GPU and prepares the next batch while the current step runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.engine import hardware, tensor_parallel
from fsdp_lab.observe.metrics import StepMetrics, StepWindow
from fsdp_lab.train.loss import Loss

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    """A non-finite loss at ``step`` (the worker adds what to do about it)."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"loss is {loss} at step {step}")
        self.step, self.loss = step, loss


@dataclass
class StepResult:
    """One optimizer step's numbers, still on the device."""

    loss: torch.Tensor  # this rank's mean loss over its micro-batches
    grad_norm: torch.Tensor  # global norm over all ranks' shards, before clipping
    skipped: torch.Tensor | None  # fp16: the grad scaler found inf/nan and skipped the update


def train_step(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    *,
    optimizer: torch.optim.Optimizer,
    scaler,
    grad_clip: float | None,
    loss: Loss | None = None,
) -> StepResult:
    """Forward/backward over the micro-batches, one gradient reduction, clip, update. Reads
    nothing back from the device: ``clip_grad_norm_`` keeps the norm there, and ``loss`` (the
    run's, else ``model(**batch).loss``) spares the forward transformers' packed-sequence
    check."""
    num_micro = len(batches)
    device = batches[0]["input_ids"].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    # FSDP2: reduce-scatter only after the last micro-batch; earlier ones accumulate locally.
    # (On XLA the compiler places the reductions in the step's one graph.)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    for i, batch in enumerate(batches):
        if set_sync is not None:
            set_sync(i == num_micro - 1)
        value = (loss(model, batch) if loss is not None else model(**batch).loss) / num_micro
        (scaler.scale(value) if scaler is not None else value).backward()
        total += value.detach().float()
    if scaler is not None:
        scaler.unscale_(optimizer)  # so clipping sees true gradient magnitudes
    # Over every mesh the parameters live on (with TP: (dp, tp) and dp), reduced on each.
    norm = tensor_parallel.clip_grad_norm(
        model.parameters(), grad_clip if grad_clip is not None else math.inf
    )
    skipped = None
    if scaler is not None:
        # The scale backs off exactly when a step is skipped; compared on the device.
        before = scaler._get_scale_async().clone()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler._get_scale_async() < before
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    hardware.mark_step(device)  # XLA: the step's graph runs here
    return StepResult(loss=total, grad_norm=norm, skipped=skipped)


# Long: the hot loop reads best in one piece (as nanoGPT's): prepare, step, boundary.
def train(
    model: nn.Module,
    *,
    data,
    loss: Loss,
    optimizer,
    scheduler,
    scaler,
    grad_clip: float | None,
    start_step: int,
    max_steps: int,
    grad_accum_steps: int,
    tokens_per_step: int,
    device: torch.device,
    place,
    log_every: int,
    boundary_at: Callable[[int], bool],
    on_records: Callable[[list[StepMetrics]], None],
    on_boundary: Callable[[int], None],
    stop_requested,
    on_step: Callable[[int], None] = lambda step: None,
) -> tuple[StepMetrics | None, bool]:
    """Run optimizer steps start_step+1..max_steps. ``place`` puts this process's rows of a
    micro-batch on its device(s).

    At every boundary (each ``log_every``-th step, the last, and the steps ``boundary_at``
    names, such as evaluations and checkpoints) every rank reads the window's numbers, passes
    them to ``on_records`` and then calls ``on_boundary(step)``. A non-finite loss (without a
    grad scaler) fails the run there, after the steps before it are recorded and before any
    checkpoint.

    Returns the last step's metrics and whether the run stopped early because some rank's
    ``stop_requested()`` said so (a preemption signal); all ranks stop after the same step.
    ``on_step(step)`` is called as each step completes (the heartbeat's step).
    """
    model.train()
    window = StepWindow(device, tokens_per_step=tokens_per_step)

    def prepare(step: int) -> list[dict[str, torch.Tensor]]:
        return [place(data.batch(step, micro)) for micro in range(grad_accum_steps)]

    last = None
    batches = prepare(start_step) if start_step < max_steps else []
    for step in range(start_step, max_steps):
        done = step + 1
        start = window.start_step()
        lr = scheduler.get_last_lr()[0]
        result = train_step(
            model, batches, optimizer=optimizer, scaler=scaler, grad_clip=grad_clip, loss=loss
        )
        scheduler.step()
        on_step(done)
        if done < max_steps:  # the next batch, copied while this step runs on the device
            batches = prepare(done)
        window.end_step(
            done,
            start=start,
            lr=lr,
            loss=result.loss,
            grad_norm=result.grad_norm,
            skipped=result.skipped,
        )
        if done % log_every and done != max_steps and not boundary_at(done):
            continue
        records, stop = window.flush(stop_requested=stop_requested())
        bad = next(
            (i for i, m in enumerate(records) if not math.isfinite(m.loss) and scaler is None), None
        )
        on_records(records[:bad])
        if bad is not None:
            raise NonFiniteLoss(records[bad].step, records[bad].loss)
        last = records[-1]
        on_boundary(done)
        if stop and done < max_steps:
            return last, True
    return last, False


@dataclass
class EvalResult:
    loss: float  # mean over every predicted validation token of every rank
    perplexity: float
    tokens: int
    time_s: float


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data,
    *,
    loss: Loss,
    num_batches: int,
    device: torch.device,
    place,
    replicas: int = 1,
) -> EvalResult:
    """Validation loss over ``num_batches`` micro-batches per rank (every rank runs the same
    number: each forward is a collective). Sums of token losses and counts are all-reduced, so
    the mean is over tokens, whatever rows a rank got or how many positions a mask chose.
    ``replicas``: ranks that see the same rows (a TP group), counted once."""
    start = time.perf_counter()
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for index in range(num_batches):
        sums += loss.token_sums(model, place(data.val_batch(index)))
        hardware.mark_step(device)
    sums = sums.to(hardware.collective_device(device))
    dist.all_reduce(sums)
    model.train()
    total, count = (x / replicas for x in sums.tolist())
    mean = total / max(count, 1.0)
    return EvalResult(
        loss=mean,
        perplexity=math.exp(min(mean, 700.0)),
        tokens=int(count),
        time_s=time.perf_counter() - start,
    )
