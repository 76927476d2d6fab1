"""The ``profile`` group: what a run records of where its time and memory go, over a window of
steps. Its own module (the schema is long); re-exported by ``fsdp_lab.config``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional

# The annotations around context parallelism's collectives (engine.context_parallel writes
# them, observe.profile.timeline reads them): kinds of their own in a trace's analysis.
CONTEXT_ALL_GATHER_REGION = "fsdp_lab::context_all_gather"
CONTEXT_REDUCE_SCATTER_REGION = "fsdp_lab::context_reduce_scatter"


class ProfileMode(enum.Enum):
    none = "none"  # the default: nothing recorded, nothing added to the loop
    trace = "trace"  # torch.profiler over the window, each rank's trace analysed
    memory = "memory"  # GPU: a CUDA memory snapshot over the window (and at an out-of-memory)


@dataclass
class ProfileConfig:
    mode: ProfileMode = ProfileMode.none
    """none; trace: torch.profiler over the window (CPU, and CUDA on a GPU): each rank's trace in
    <run dir>/profile/rank{r}.trace.json.gz (Perfetto, chrome://tracing), analysed right after
    the window into run.json's `profile` section (compute, communication, exposed communication
    and idle time per step and per FSDP unit) and profile/timeline.png; memory (hardware=gpu):
    the allocator's history from the first step to the window's end as
    profile/rank{r}.memory.pickle (pytorch.org/memory_viz) and .html, and one written on an
    out-of-memory error."""
    wait: int = 3
    """Steps after the run's first (or a resumed run's first) before the window: the first
    steps include allocation, compilation and the first collectives."""
    warmup: int = 1
    """Steps recorded and thrown away at the window's start (the profiler's own start-up)."""
    active: int = 3
    """Steps recorded and analysed."""
    ranks: Optional[List[int]] = None
    """The ranks that record; null: all of them."""
    record_shapes: bool = False
    """trace: each operator's input shapes in the trace (a larger trace, slower to write)."""
    with_stack: bool = False
    """trace: each operator's Python stack in the trace (a larger trace, slower to write)."""
    memory_entries: int = 100_000
    """memory: allocation events the snapshot keeps (the oldest are dropped)."""

    def window(self, start_step: int) -> tuple[int, int]:
        """(first, last) optimizer step analysed (1-based, as metrics.jsonl counts) for a run
        whose loop starts after ``start_step``."""
        first = start_step + self.wait + self.warmup + 1
        return first, first + self.active - 1

    def records(self, rank: int) -> bool:
        return self.mode is not ProfileMode.none and (self.ranks is None or rank in self.ranks)


def profile_problem(p: ProfileConfig, *, max_steps: int, world_size: int, kind: str) -> str | None:
    """What is wrong with the profile against the run's steps, ranks and device (``kind``: the
    resolved hardware kind's name), in one line naming the setting and the fix; None if
    nothing (``rules.validate`` raises it as a ConfigError)."""
    if p.mode is ProfileMode.none:
        return None
    for name in ("wait", "warmup"):
        if getattr(p, name) < 0:
            return f"profile.{name}={getattr(p, name)} must be >= 0"
    if p.active < 1:
        return f"profile.active={p.active} must be >= 1 (the steps analysed)"
    first, last = p.window(0)
    if last > max_steps:
        return (
            f"profile={p.mode.name} records steps {first}-{last}, after trainer.max_steps="
            f"{max_steps}; raise trainer.max_steps to {last} or lower profile.wait "
            f"({p.wait}) / profile.warmup ({p.warmup}) / profile.active ({p.active})"
        )
    bad = [r for r in p.ranks or [] if not 0 <= r < world_size]
    if bad or p.ranks == []:
        return (
            f"profile.ranks={p.ranks}: ranks run 0-{world_size - 1}; list some of them, "
            "or null for all"
        )
    if kind == "tpu":
        return (
            f"profile={p.mode.name} with hardware=tpu: torch_xla has its own profiler "
            "(torch_xla.debug.profiler); use profile=none"
        )
    if p.mode is ProfileMode.memory and kind != "gpu":
        return (
            f"profile=memory records the CUDA allocator and needs hardware=gpu (got "
            f"hardware={kind}); on CPU use profile=trace, or `fsdp-lab plan` for the memory "
            "a rank will need"
        )
    if p.memory_entries < 1:
        return f"profile.memory_entries={p.memory_entries} must be >= 1"
    return None
