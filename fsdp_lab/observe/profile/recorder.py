"""One rank's profiler over the window of steps ``profile=trace|memory`` asks for.

Every rank keeps a ``WindowProfiler`` and tells it of each step, recording or not, so every
rank knows when the window ends (its analysis is gathered there, a collective). With
profile=none it does nothing: no profiler, no annotations (``region`` is a null context).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from fsdp_lab.config import ProfileConfig, ProfileMode
from fsdp_lab.engine.hardware import memory
from fsdp_lab.observe.profile.analysis import analyse_trace
from fsdp_lab.observe.profile.result import RankProfile
from fsdp_lab.observe.profile.timeline import DATA_REGION, STEP_PREFIX

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROFILE_DIR / f"rank{rank}.trace.json.gz"


def memory_paths(run_dir: Path, rank: int, tag: str = "memory") -> tuple[Path, Path]:
    """(snapshot pickle, HTML view) of a memory snapshot; tag ``oom`` for the one written at an
    out-of-memory error."""
    out = run_dir / PROFILE_DIR
    return out / f"rank{rank}.{tag}.pickle", out / f"rank{rank}.{tag}.html"


class WindowProfiler:
    """This rank's part of the profile: ``step(done)`` after each optimizer step says whether
    the window just ended (the same answer on every rank)."""

    def __init__(
        self,
        cfg: ProfileConfig,
        *,
        rank: int,
        device: torch.device,
        run_dir: Path,
        start_step: int,
    ) -> None:
        self.cfg, self.rank, self.run_dir = cfg, rank, run_dir
        self.first, self.last = cfg.window(start_step)
        self.records = cfg.records(rank)
        self.tracing = self.records and cfg.mode is ProfileMode.trace
        self._torch_profiler = None
        self.trace_written_s = 0.0  # seconds to export this rank's trace
        if self.records:
            (run_dir / PROFILE_DIR).mkdir(parents=True, exist_ok=True)
        if self.tracing:
            self._torch_profiler = torch.profiler.profile(
                activities=memory.profiler_activities(device),
                schedule=torch.profiler.schedule(
                    wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1
                ),
                on_trace_ready=self._export,
                record_shapes=cfg.record_shapes,
                with_stack=cfg.with_stack,
            )
            self._torch_profiler.start()
        elif self.records:  # memory: from the first step, so an out-of-memory error has history
            memory.start_memory_history(cfg.memory_entries)
            memory.on_out_of_memory(self._dump_at_oom)

    @classmethod
    def start(
        cls,
        cfg: ProfileConfig,
        *,
        rank: int,
        device: torch.device,
        run_dir: Path,
        start_step: int,
        max_steps: int,
    ) -> WindowProfiler:
        """The run's profiler; a disabled one where the window lies past the last step (a
        resumed run whose start is late: the rules checked the window of a fresh run)."""
        first, last = cfg.window(start_step)
        if cfg.mode is not ProfileMode.none and last > max_steps:
            if rank == 0:
                log.warning(
                    "profile=%s: steps %d-%d lie past trainer.max_steps=%d for a run that "
                    "starts at step %d; nothing is profiled",
                    cfg.mode.name,
                    first,
                    last,
                    max_steps,
                    start_step,
                )
            return cls.disabled()
        return cls(cfg, rank=rank, device=device, run_dir=run_dir, start_step=start_step)

    @classmethod
    def disabled(cls) -> WindowProfiler:
        """profile=none: no profiler, no annotation, no window."""
        return cls(
            ProfileConfig(), rank=0, device=torch.device("cpu"), run_dir=Path(), start_step=0
        )

    @property
    def enabled(self) -> bool:
        return self.cfg.mode is not ProfileMode.none

    def step_region(self, step: int):
        """Around one optimizer step's work (the step and the next batch's preparation), named
        so the analysis finds the step and its number."""
        return self.region(f"{STEP_PREFIX}{step}")

    def data_region(self):
        return self.region(DATA_REGION)

    def region(self, name: str):
        if not self.tracing:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)

    def step(self, done: int) -> bool:
        """Optimizer step ``done`` finished: advance the profiler. True on every rank when
        ``done`` is the window's last step."""
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if done != self.last or not self.enabled:
            return False
        if self.records and self.cfg.mode is ProfileMode.memory:
            pickle_path, html_path = memory_paths(self.run_dir, self.rank)
            memory.dump_memory_history(pickle_path, html_path)
            memory.stop_memory_history()
        return True

    def _export(self, prof) -> None:
        started = time.perf_counter()
        prof.export_chrome_trace(str(trace_path(self.run_dir, self.rank)))
        self.trace_written_s = time.perf_counter() - started

    def _dump_at_oom(self) -> None:
        pickle_path, _ = memory_paths(self.run_dir, self.rank, "oom")
        try:
            memory.dump_memory_history(pickle_path, None)  # no HTML: memory is short now
        except Exception as e:  # noqa: BLE001 - the out-of-memory error itself must surface
            log.warning("could not write the out-of-memory snapshot %s: %s", pickle_path, e)
            return
        log.error("out of memory: allocator history in %s (pytorch.org/memory_viz)", pickle_path)

    def analyse(self) -> RankProfile | None:
        """This rank's window, read back from the trace it wrote (so ``fsdp-lab profile``
        reads the same numbers from it later); None where this rank did not trace."""
        path = trace_path(self.run_dir, self.rank)
        if not self.tracing or not path.is_file():
            return None
        self.close()
        return analyse_trace(path, rank=self.rank, relative_to=self.run_dir)

    def close(self) -> None:
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            self._torch_profiler = None
