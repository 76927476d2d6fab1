"""The training step and loop: plain PyTorch on an FSDP2 model, with no host sync in the step.

Between logging boundaries (``trainer.log_every`` steps, evaluations, checkpoints, the last
step) nothing waits for the device: the step's loss, gradient norm and skip flag stay device
tensors and ``metrics.StepWindow`` reads a whole window of them at the boundary. So the host runs
ahead of the GPU and prepares the next batch while the current step runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from fsdp_lab.config import TrainerConfig
from fsdp_lab.engine import attention, context_parallel, tensor_parallel
from fsdp_lab.engine.hardware import devices, memory, process_group
from fsdp_lab.engine.moe import MoeStep
from fsdp_lab.internals import torch_private
from fsdp_lab.observe.heartbeat import Heartbeat
from fsdp_lab.observe.metrics import StepMetrics, StepWindow
from fsdp_lab.observe.profile.recorder import WindowProfiler
from fsdp_lab.observe.profile.result import RankProfile
from fsdp_lab.train.evaluation import EvalResult, evaluate
from fsdp_lab.train.loss import Loss

if TYPE_CHECKING:
    from fsdp_lab.engine.pipeline import Pipeline
    from fsdp_lab.observe.record import SampleRecord
    from fsdp_lab.train.build import TrainState
    from fsdp_lab.train.evaluation import HarnessScores

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    """A non-finite loss at ``step`` (the worker adds what to do about it), and the step
    before it (None: the first step of this run)."""

    def __init__(self, step: int, loss: float, before: StepMetrics | None = None) -> None:
        super().__init__(f"loss is {loss} at step {step}")
        self.step, self.loss, self.before = step, loss, before


@dataclass
class StepResult:
    """One optimizer step's numbers, still on the device."""

    # This rank's summed token losses x dp x cp / the global targets: averaged over the world's
    # ranks (``StepWindow.flush``) it is the mean over the global batch's trained tokens (a TP
    # group's ranks hold the same value and are as many in every group; a CP group's hold
    # their own tokens' sums).
    loss: torch.Tensor
    grad_norm: torch.Tensor  # global norm over all ranks' shards, before clipping
    skipped: torch.Tensor | None  # fp16: the grad scaler found inf/nan and skipped the update
    moe: MoeStep | None = None  # a mixture of experts' aux loss and expert load (global)


def loss_scale(targets: int, dp: int, device: torch.device) -> torch.Tensor:
    """dp / targets as an fp32 scalar on the device: copied as a batch is (no host wait; on XLA
    device data, not a constant baked into the graph, which would recompile every step)."""
    scale = torch.tensor(dp / max(targets, 1), dtype=torch.float32)
    return devices.to_device({"scale": scale}, device)["scale"]


def averaged_ranks(data) -> int:
    """The participants of the gradient average: FSDP2's reduce-scatter (and HSDP's all-reduce)
    averages over its mesh, dp_replicate x dp_shard x context (the loader's dp_size times its
    CP group: a CP group's ranks hold different tokens of the same rows, each summing its own;
    a TP group's ranks read the same rows and are one). On XLA one process computes the
    gradient of its devices' rows as one program, summed, not averaged: the loader's
    local_ranks are one."""
    return data.dp_size * data.context // data.local_ranks


# Many parameters: the step's pieces, keyword-only.
def train_step(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    *,
    targets: int,
    dp: int,
    optimizer: torch.optim.Optimizer,
    scaler,
    grad_clip: float | None,
    loss: Loss,
    pipeline: Pipeline | None = None,
) -> StepResult:
    """Forward/backward over the micro-batches, one gradient reduction, clip, update.

    The loss is the mean over the global batch's trained tokens: each micro-batch's summed
    token losses times ``dp / targets`` (``targets``: every rank's and micro-batch's, counted
    on the host by the loader; ``dp``: the ranks the gradient is averaged over, which undoes
    the average into a sum). Reads nothing back from the device: the scale is copied there as
    the batches are, ``clip_grad_norm_`` keeps the norm there, and ``loss`` spares the forward
    transformers' packed-sequence check. A ``pipeline``'s schedule runs each micro-batch."""
    num_micro = len(batches)
    device = batches[0]["input_ids"].device
    scale = loss_scale(targets, dp, device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    # FSDP2: reduce-scatter only after the last micro-batch; earlier ones accumulate locally.
    # (On XLA the compiler places the reductions in the step's one graph.)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    for i, batch in enumerate(batches):
        if pipeline is not None:  # forward and backward, by the schedule
            total += pipeline.train_value(batch, scale, scaler)
            continue
        if set_sync is not None:
            set_sync(i == num_micro - 1)
        value = loss.train_value(model, batch, scale=scale, num_micro=num_micro)
        (scaler.scale(value) if scaler is not None else value).backward()
        total += value.detach().float()
    if pipeline is not None:  # the last stage's loss, on every stage's ranks
        total = pipeline.reduce(total)
    if scaler is not None:
        scaler.unscale_(optimizer)  # so clipping sees true gradient magnitudes
    # Over every mesh the parameters live on (with TP: (dp, tp) and dp), reduced on each.
    norm = tensor_parallel.clip_grad_norm(
        model.parameters(),
        grad_clip if grad_clip is not None else math.inf,
        pipeline=pipeline.group if pipeline is not None else None,
    )
    skipped = None
    if scaler is not None:
        # The scale backs off exactly when a step is skipped; compared on the device.
        before = torch_private.scale_on_device(scaler).clone()
        scaler.step(optimizer)
        scaler.update()
        skipped = torch_private.scale_on_device(scaler) < before
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    devices.mark_step(device)  # XLA: the step's graph runs here
    moe = loss.router.take() if loss.router is not None else None
    return StepResult(loss=total, grad_norm=norm, skipped=skipped, moe=moe)


class Recorder(Protocol):
    """Where the loop's numbers go: rank 0's ``train.reporter.Reporter`` (other ranks: None)."""

    def train_records(self, records: list[StepMetrics]) -> None: ...

    def validation(self, step: int, result: EvalResult) -> None: ...

    def samples(self, step: int, samples: list[SampleRecord], time_s: float) -> None: ...

    def harness(self, step: int, result: HarnessScores) -> None: ...

    def profile(self, ranks: list[RankProfile], *, analysis_s: float) -> None: ...


@dataclass(frozen=True)
class LoopSetup:
    """What the loop runs by besides the train state (``train.build.TrainState``: the model,
    loss, data, optimizer, checkpointer and the step to start from): its schedule, where its
    numbers go and what tells it to stop. The worker builds it from what belongs to its rank."""

    trainer: TrainerConfig  # max_steps, grad_accum_steps, log_every, eval_every
    grad_clip: float | None
    device: torch.device
    tp_ranks: int = 1  # ranks that see the same rows (a TP group): evaluation counts them once
    reporter: Recorder | None = None  # rank 0's; the other ranks record nothing
    stop_requested: Callable[[], bool] = lambda: False  # a preemption signal (preempt.StopFlag)
    heartbeat: Heartbeat | None = None  # told of each step as it completes
    profiler: WindowProfiler | None = None  # profile=trace|memory: told of each step
    trim_host_heap: bool = False  # hardware.malloc_trim on a CPU rank: after each step


@dataclass(frozen=True)
class LoopEnd:
    last: StepMetrics | None  # the last step's numbers; None when no step ran
    preempted: bool  # some rank's stop_requested(): every rank stopped after the same step
    saved_step: int | None  # the last step the loop checkpointed at; None: none


# Long: the loop reads best in one piece (nanoGPT's): step; at a boundary record, eval, save.
def train(state: TrainState, setup: LoopSetup) -> LoopEnd:
    """Run optimizer steps state.start_step+1..trainer.max_steps. A fresh run is evaluated
    first: the starting point (a pretrained model's) is a number too.

    A boundary is each ``log_every``-th step, the last, and the steps that evaluate
    (``eval_every``) or checkpoint (``checkpoint.every_n_steps``). Only there does anything wait
    for the device: every rank reads the window's numbers, rank 0 records them, then every rank
    evaluates and checkpoints as the step asks. A non-finite loss (without a grad scaler) fails
    the run there, after the steps before it are recorded and before any checkpoint. A stop
    request (a preemption signal on any rank) ends the loop at the next boundary, on every rank
    after the same step.
    """
    t, ckpt, model = setup.trainer, state.checkpointer, state.sharded.model
    if state.start_step == 0:
        _evaluate_at(state, setup, 0)
        if state.evals is not None and state.evals.harness_due(0):
            _score_at(state, setup, 0)
    model.train()
    window = StepWindow(setup.device, tokens_per_step=state.tokens_per_step)

    place, data, dp = state.sharded.place_batch, state.data, averaged_ranks(state.data)
    prof = setup.profiler or WindowProfiler.disabled()

    def prepare(step: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        """This rank's micro-batches on the device and the global batch's targets (host)."""
        rows, count = data.step_batches(step)
        return [place(batch) for batch in rows], count

    last, saved_step, scaled = None, None, state.scaler is not None
    batches, targets = prepare(state.start_step) if state.start_step < t.max_steps else ([], 0)
    for step in range(state.start_step, t.max_steps):
        done = step + 1
        # 1) The step, queued on the device; nothing is read back.
        start = window.start_step()
        lr = state.scheduler.get_last_lr()[0]
        with prof.step_region(done):
            result = train_step(
                model,
                batches,
                targets=targets,
                dp=dp,
                optimizer=state.optimizer,
                scaler=state.scaler,
                grad_clip=setup.grad_clip,
                loss=state.loss,
                pipeline=state.sharded.pipeline,
            )
            state.sharded.after_optimizer_step()  # float8: the next step's weight scales
            state.scheduler.step()
            if setup.trim_host_heap:  # freed tensors' pages back to the system, every step
                memory.trim_host_heap()
            if setup.heartbeat is not None:
                setup.heartbeat.step_done(done)
            trained = targets  # this step's, before the next step's batches replace them
            if done < t.max_steps:  # the next batch, copied while this step runs on the device
                with prof.data_region():
                    batches, targets = prepare(done)
        window.end_step(
            done,
            start=start,
            lr=lr,
            trained_tokens=trained,
            loss=result.loss,
            grad_norm=result.grad_norm,
            skipped=result.skipped,
            moe=result.moe,
        )
        profiled = prof.step(done)  # the profile's window ended: on every rank
        evaluates = _evaluates(state, t, done)
        saves = ckpt.should_save(done)
        if done % t.log_every and done != t.max_steps and not (evaluates or saves or profiled):
            continue
        # 2) A boundary: every rank reads the window (and whether any rank was signalled).
        records, stop = window.flush(stop_requested=setup.stop_requested())
        # A grad scaler skips a non-finite step itself; without one the run fails here.
        bad = next(
            (i for i, m in enumerate(records) if not math.isfinite(m.loss) and not scaled), None
        )
        if setup.reporter is not None:
            setup.reporter.train_records(records[:bad])
        if bad is not None:
            before = records[bad - 1] if bad else last
            raise NonFiniteLoss(records[bad].step, records[bad].loss, before)
        last = records[-1]
        if profiled:  # after the window's step records: trackers take steps in order
            _profile_window(prof, setup.reporter)
        # 3) Evaluation, on every rank (each forward is a collective).
        if evaluates:
            _evaluate_at(state, setup, done)
        # 4) The checkpoint: an async one in flight finished, this step's written.
        ckpt.poll()
        if saves:
            # Saved, or skipped under on_save_error=continue: not tried twice at one step.
            ckpt.save(done, tokens_seen(state, done))
            saved_step = done
        # 5) Harness scores, after the checkpoint: a long or failing task loses no step.
        if state.evals is not None and state.evals.harness_due(done):
            _score_at(state, setup, done)
        if stop and done < t.max_steps:
            return LoopEnd(last, preempted=True, saved_step=saved_step)
    return LoopEnd(last, preempted=False, saved_step=saved_step)


def _profile_window(prof: WindowProfiler, reporter: Recorder | None) -> None:
    """Each rank's window analysed from its trace, gathered to rank 0 (a collective: every rank
    takes part, traced or not), recorded there."""
    started = time.perf_counter()
    mine = prof.analyse()
    gathered = process_group.gather_from_processes((mine, time.perf_counter() - started))
    if reporter is not None:
        ranks = [profile for profile, _ in gathered if profile is not None]
        reporter.profile(ranks, analysis_s=max(seconds for _, seconds in gathered))


def tokens_seen(state: TrainState, step: int) -> int:
    """Positions trained on through ``step`` (every position of every row, ``tokens_per_step``
    a step, as throughput counts them; not only the trained targets): a resumed run's before
    it, and this run's since."""
    return state.tokens_seen + (step - state.start_step) * state.tokens_per_step


def _validates(state: TrainState, t: TrainerConfig, step: int) -> bool:
    """Validation loss at step 0 (a fresh run), every eval_every steps and after the last."""
    return bool(state.eval_batches) and (step % t.eval_every == 0 or step == t.max_steps)


def _evaluates(state: TrainState, t: TrainerConfig, step: int) -> bool:
    """Any evaluation at this step: validation, generations or harness scores."""
    evals = state.evals
    return _validates(state, t, step) or (
        evals is not None and (evals.samples_due(step) or evals.harness_due(step))
    )


def _evaluate_at(state: TrainState, setup: LoopSetup, step: int) -> None:
    """Validation and generations due at ``step``, on every rank (each forward is a
    collective); harness scores come after the step's checkpoint (``_score_at``)."""
    model, reporter, evals = state.sharded.model, setup.reporter, state.evals
    if _validates(state, setup.trainer, step):
        result = evaluate(
            model,
            state.data,
            loss=state.loss,
            num_batches=state.eval_batches,
            device=setup.device,
            place=state.sharded.place_batch,
            tp_ranks=setup.tp_ranks,
            pipeline=state.sharded.pipeline,
        )
        if reporter is not None:
            reporter.validation(step, result)
    if evals is None:
        return
    if evals.samples_due(step):
        started = time.perf_counter()
        with _whole_sequences(state, evals.keep_gathered) as generating:
            samples = evals.generate(generating, step)
        if reporter is not None:
            reporter.samples(step, samples, time.perf_counter() - started)


def _score_at(state: TrainState, setup: LoopSetup, step: int) -> None:
    """lm-eval's scores of the model being trained, on every rank (after the step's
    checkpoint)."""
    evals = state.evals
    with _whole_sequences(state, evals.keep_gathered) as scoring:
        scores = evals.score(scoring)
    if setup.reporter is not None:
        setup.reporter.harness(step, scores)


@contextlib.contextmanager
def _whole_sequences(state: TrainState, keep_gathered: bool):
    """Generation and scoring: many small forwards over whole sequences, on every rank (a
    context-parallel model attends over them, not over a split, inside), with their padding
    masks built by transformers (not the training step's, ``engine.attention``). Yields the
    model they run: the sharded one, or a pipeline's whole model gathered on every rank."""
    with (
        state.sharded.generation_model(keep_gathered) as model,
        context_parallel.whole_sequences(model),
        attention.transformers_masks(model),
    ):
        yield model
