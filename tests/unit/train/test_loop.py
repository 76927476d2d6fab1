"""The training loop on a one-process gloo group: no host read between logging boundaries,
every step recorded whatever trainer.log_every is, and stops and failures at boundaries."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fsdp_lab.config import OptimImpl, compose
from fsdp_lab.data.loader import build_data
from fsdp_lab.engine import fsdp
from fsdp_lab.engine import model as model_lib
from fsdp_lab.engine.hardware import devices
from fsdp_lab.observe import metrics
from fsdp_lab.planning import plan
from fsdp_lab.train import loop
from fsdp_lab.train import loss as loss_lib
from fsdp_lab.train.optim import build_optimizer, build_scheduler, resolve_implementation


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def build_run(*overrides: str, implementation: OptimImpl | None = None):
    """The worker's recipe (model on meta, loss, FSDP2, optimizer, data) on this process."""
    cfg = compose(["hardware=cpu", "hardware.nproc_per_node=1", *overrides])
    topo, _ = plan.topology(cfg)
    hf = model_lib.build_hf_config(cfg.model)
    kind = loss_lib.resolve_loss(cfg.loss, hf, cfg.model.task, topo.device, compiled=False)
    meta, loss = loss_lib.meta_model_with_loss(cfg, hf, kind, compiled=False)
    device = torch.device("cpu")
    sharded = fsdp.build_model(
        cfg, topo, device, meta_model=meta, source=lambda: model_lib.build_full_model(hf, seed=0)
    )
    impl = implementation or resolve_implementation(cfg.optim, topo.device, grad_scaler=False)
    optimizer = build_optimizer(sharded.model, cfg.optim, implementation=impl)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.trainer.max_steps)
    data = build_data(
        cfg, corpus=None, tokenizer=None, vocab_size=hf.vocab_size, dp_size=1, dp_rank=0
    )
    return cfg, sharded, optimizer, scheduler, data, loss


class Recorded:
    """Rank 0's reporter, as the loop sees it: each boundary's window of records."""

    def __init__(self, on_records=None):
        self.records, self.boundaries, self.on_records = [], [], on_records

    def train_records(self, batch):
        self.records.extend(batch)
        if batch:
            self.boundaries.append(batch[-1].step)
        if self.on_records is not None:
            self.on_records(batch)

    def validation(self, step, result):
        raise AssertionError("no evaluation configured")


class SavesAt:
    """A checkpointer that asks for a boundary at ``step`` and writes nothing."""

    def __init__(self, step):
        self.step = step

    def should_save(self, step):
        return step == self.step

    def poll(self):
        pass

    def save(self, step, tokens_seen):
        pass


def train_state(sharded, optimizer, scheduler, data, loss, *, checkpointer, tokens_per_step):
    """The parts of ``train.build.TrainState`` the loop reads."""
    return SimpleNamespace(
        sharded=sharded,
        data=data,
        loss=loss,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=None,
        checkpointer=checkpointer,
        start_step=0,
        tokens_seen=0,
        tokens_per_step=tokens_per_step,
        eval_batches=0,
        evals=None,
    )


def run_loop(*overrides: str, stop: bool = False, implementation=None, on_records=None):
    cfg, *parts = build_run(*overrides, implementation=implementation)
    t = cfg.trainer
    reporter = Recorded(on_records)
    state = train_state(
        *parts, checkpointer=SavesAt(6), tokens_per_step=t.micro_batch_size * t.seq_len
    )
    setup = loop.LoopSetup(
        trainer=dataclasses.replace(t, grad_accum_steps=1),
        grad_clip=1.0,
        device=torch.device("cpu"),
        reporter=reporter,
        stop_requested=lambda: stop,
    )
    end = loop.train(state, setup)
    return reporter.records, reporter.boundaries, end.preempted


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("loss", ["loss=chunked", "loss=hf"])
def test_the_step_reads_nothing_from_the_device_between_boundaries(gloo_group, monkeypatch, loss):
    """Every read of a tensor's value (a host sync on a GPU) happens inside the window's flush
    at a boundary: none in the steps between (transformers' own packed-sequence check, one
    read per forward, included: see engine.attention). The loader's count of a step's
    targets reads host tensors before anything is placed on the device: not a device read."""
    state = {"step": 0, "flushing": False, "on_host": False}
    reads: list[tuple[int, str]] = []

    def counted(name, original):
        def read(self, *args, **kwargs):
            if not state["flushing"] and not state["on_host"]:
                reads.append((state["step"], name))
            return original(self, *args, **kwargs)

        return read

    step, flush = loop.train_step, metrics.StepWindow.flush

    def counted_step(*args, **kwargs):
        state["step"] += 1
        return step(*args, **kwargs)

    def counted_flush(self, **kwargs):
        state["flushing"] = True
        try:
            return flush(self, **kwargs)
        finally:
            state["flushing"] = False

    _cfg, sharded, optimizer, scheduler, data, run_loss = build_run("trainer.max_steps=10", loss)
    host_batches = data.step_batches

    def step_batches(step):
        state["on_host"] = True
        try:
            batches, targets = host_batches(step)
            assert all(t.device.type == "cpu" for b in batches for t in b.values())
            return batches, targets
        finally:
            state["on_host"] = False

    data.step_batches = step_batches
    monkeypatch.setattr(loop, "train_step", counted_step)
    monkeypatch.setattr(metrics.StepWindow, "flush", counted_flush)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    windows = []
    reporter = Recorded(lambda batch: windows.append([m.step for m in batch]))
    loop.train(
        train_state(
            sharded,
            optimizer,
            scheduler,
            data,
            run_loss,
            checkpointer=SavesAt(-1),
            tokens_per_step=256,
        ),
        loop.LoopSetup(
            trainer=dataclasses.replace(
                _cfg.trainer, max_steps=10, grad_accum_steps=1, log_every=4
            ),
            grad_clip=1.0,
            device=torch.device("cpu"),
            reporter=reporter,
        ),
    )
    assert state["step"] == 10 and reads == []
    assert windows == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]


def test_every_step_is_recorded_whatever_log_every_is(gloo_group):
    """The same steps, keys and losses (bitwise) when read every step or in windows; the
    boundaries are each log_every-th step, the ones the worker asks for and the last."""
    every, b1, _ = run_loop("trainer.max_steps=9", "trainer.log_every=1")
    windowed, b4, _ = run_loop("trainer.max_steps=9", "trainer.log_every=4")
    assert [m.step for m in every] == [m.step for m in windowed] == list(range(1, 10))
    assert [m.loss for m in every] == [m.loss for m in windowed]
    assert [m.grad_norm for m in every] == [m.grad_norm for m in windowed]
    assert every[0].as_record().keys() == windowed[0].as_record().keys()
    assert b1 == list(range(1, 10)) and b4 == [4, 6, 8, 9]
    for m in windowed:
        assert m.step_time_s > 0 and m.tokens_per_s > 0 and m.peak_mem_bytes > 0
    elapsed = [m.elapsed_s for m in windowed]
    assert elapsed == sorted(elapsed)


def test_a_stop_request_is_acted_on_at_the_next_boundary(gloo_group):
    """A signal during step 1 stops every rank after step 4 (log_every=4): at most
    log_every - 1 steps later, all of them recorded."""
    records, boundaries, stopped = run_loop(
        "trainer.max_steps=20", "trainer.log_every=4", stop=True
    )
    assert stopped and [m.step for m in records] == [1, 2, 3, 4] and boundaries == [4]


def test_a_non_finite_loss_fails_at_the_boundary_naming_its_step(gloo_group):
    seen = []
    with pytest.raises(FloatingPointError, match=r"loss is nan at step \d+"):
        run_loop(
            "trainer.max_steps=8",
            "trainer.log_every=8",
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "optim.grad_clip=null",
            on_records=lambda batch: seen.extend(m.step for m in batch),
        )
    assert seen == list(range(1, len(seen) + 1))  # the finite steps before it, recorded
    assert all(math.isfinite(m) for m in seen)


def test_a_boundary_records_then_evaluates_then_checkpoints(gloo_group):
    """The loop's own order at a boundary (evaluation and checkpoint visible in it): a fresh
    run is evaluated at step 0; then records, evaluation, the finished async save, the save."""
    cfg, *parts = build_run("trainer.max_steps=6")
    events = []

    class Reporter(Recorded):
        def train_records(self, batch):
            events.append(("records", [m.step for m in batch]))

        def validation(self, step, result):
            assert math.isfinite(result.loss) and result.tokens > 0
            events.append(("eval", step))

    class Checkpointer(SavesAt):
        def poll(self):
            events.append(("poll",))

        def save(self, step, tokens_seen):
            events.append(("save", step, tokens_seen))

    state = train_state(*parts, checkpointer=Checkpointer(3), tokens_per_step=100)
    state.eval_batches = 1
    trainer = dataclasses.replace(cfg.trainer, log_every=2, eval_every=3, grad_accum_steps=1)
    setup = loop.LoopSetup(
        trainer=trainer, grad_clip=1.0, device=torch.device("cpu"), reporter=Reporter()
    )
    end = loop.train(state, setup)
    assert events == [
        ("eval", 0),
        ("records", [1, 2]),
        ("poll",),
        ("records", [3]),
        ("eval", 3),
        ("poll",),
        ("save", 3, 300),
        ("records", [4]),
        ("poll",),
        ("records", [5, 6]),
        ("eval", 6),
        ("poll",),
    ]
    assert end.last.step == 6 and not end.preempted and end.saved_step == 3


def test_fused_foreach_and_for_loop_adamw_agree(gloo_group):
    losses = {
        impl: [m.loss for m in run_loop("trainer.max_steps=4", implementation=impl)[0]]
        for impl in (OptimImpl.fused, OptimImpl.foreach, OptimImpl.for_loop)
    }
    ref = losses[OptimImpl.for_loop]
    for impl, values in losses.items():
        assert max(abs(a - b) for a, b in zip(values, ref, strict=True)) <= 1e-6, impl


@pytest.mark.parametrize(
    "device,scaler,want",
    [
        ("cpu", False, OptimImpl.fused),
        ("gpu", False, OptimImpl.fused),
        ("tpu", False, OptimImpl.foreach),
        ("gpu", True, OptimImpl.foreach),
    ],
)
def test_auto_optimizer_implementation(device, scaler, want):
    from fsdp_lab.config import HardwareKind, OptimConfig

    assert resolve_implementation(OptimConfig(), HardwareKind[device], grad_scaler=scaler) is want


def test_step_clock_reads_cuda_events_only_at_a_boundary(monkeypatch):
    """On GPU a step's start and end are CUDA events (recorded, not waited on); their time is
    read when the window is flushed."""
    recorded, synced = [], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            recorded.append(self)

        def synchronize(self):
            synced.append(self)

        def elapsed_time(self, end):
            return 250.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = devices.StepClock(torch.device("cuda", 0))
    start, end = clock.mark(), clock.mark()
    assert len(recorded) == 2 and synced == []
    assert clock.seconds(start, end) == 0.25 and synced == [end]
