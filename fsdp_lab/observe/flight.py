"""What torch's flight recorder says of a hang: the last collective each rank entered.

A heartbeat names the rank that stopped; it cannot tell a rank that is behind from ranks that
all beat but entered different collectives (a mismatch: one rank all-reduces where another
all-gathers), which hangs just the same. torch records every collective a process group
issues in a ring (``TORCH_FR_BUFFER_SIZE`` entries; ``hardware.flight_recorder``): its
sequence number in the group, the op, the sizes, its state and the Python stack that issued it.
A rank whose collective timed out writes its record to ``logs/rank{r}.flight.json``; with NCCL
the watchdog writes ``logs/flight_watchdog_rank{r}`` (a pickle) itself on a timeout. A rank that
is stopped or killed writes none.

Torch-free (the launcher reads the dumps). A pickled dump holds plain containers only, so it is
read by an unpickler that refuses every class or function a pickle could name.
"""

from __future__ import annotations

import io
import json
import math
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

WATCHDOG_PREFIX = "flight_watchdog_rank"  # NCCL's watchdog appends the rank


def dump_file(log_dir: Path, rank: int) -> Path:
    """Where a rank writes its own record when its collective timed out."""
    return log_dir / f"rank{rank}.flight.json"


def watchdog_prefix(log_dir: Path) -> Path:
    """The file name NCCL's watchdog writes its dump to, less the rank it appends."""
    return log_dir / WATCHDOG_PREFIX


def clear(log_dir: Path, rank: int) -> None:
    """Remove a rank's dumps from an earlier attempt in this run dir (a resumed run): a hang
    now must not be explained by the last one's record."""
    for path in (dump_file(log_dir, rank), Path(f"{watchdog_prefix(log_dir)}{rank}")):
        path.unlink(missing_ok=True)


class _PlainData(pickle.Unpickler):
    """Dicts, lists, tuples, strings and numbers only: a pickle that names any class or
    function (the only way a pickle runs code) is refused before anything is called."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(
            f"refused {module}.{name}: a flight recorder dump holds plain data only"
        )


def parse(raw: bytes) -> dict:
    """A dump as torch writes it: JSON (``_dump_fr_trace_json``) or a pickle (the watchdog's
    file, ``_dump_fr_trace``)."""
    if raw.lstrip()[:1] == b"{":
        return json.loads(raw)
    return _PlainData(io.BytesIO(raw)).load()


# Frames that only pass a collective on: the code that issued it is the first frame outside.
_WRAPPERS = ("/torch/", "/typing_extensions.py", "/contextlib.py", "/functools.py")


@dataclass(frozen=True)
class Collective:
    """One collective as a rank entered it."""

    seq: int  # its collective sequence number in its process group
    op: str  # all_reduce, all_gather_into_tensor... (the backend's prefix removed)
    group: str  # the process group's description (default_pg)
    elements: int  # input elements
    state: str  # NCCL: scheduled, started, completed; gloo records "scheduled" only
    created_ns: int  # when the rank entered it
    frame: str | None  # where in code outside torch it was issued ("loop.py:120 in step")

    def what(self, *, group: bool = True) -> str:
        """The op, its size, its group (unless ``group`` is false) and where it came from."""
        parts = [self.op, f"{self.elements} elements"]
        parts += [self.group] if group else []
        parts += [f"from {self.frame}"] if self.frame else []
        return ", ".join(parts)


@dataclass(frozen=True)
class RankRecord:
    """A rank's record: its collectives by process group (name) and sequence number."""

    rank: int
    groups: dict[str, dict[int, Collective]]
    # NCCL's watchdog marks collectives started and completed; gloo's stay "scheduled", and
    # its group status counts a collective that failed as completed, so only the order is
    # known there.
    tracks_state: bool

    def current(self, group: str) -> Collective | None:
        """Where this rank is in ``group``: its oldest collective not completed where states
        are tracked (NCCL queues later ones behind it), else the last it entered."""
        entries = self.groups.get(group)
        if not entries:
            return None
        pending = [s for s, c in entries.items() if c.state != "completed"]
        return entries[min(pending) if self.tracks_state and pending else max(entries)]

    def newest_group(self) -> str | None:
        """The group of the last collective this rank entered: on a CPU, where each waits in
        turn, the one a rank whose collective timed out waits in."""
        newest = [(c.created_ns, name) for name, g in self.groups.items() for c in g.values()]
        return max(newest)[1] if newest else None


def record(dump: dict, rank: int) -> RankRecord:
    """The collectives (not point-to-point ops) of a parsed dump."""
    groups: dict[str, dict[int, Collective]] = {}
    for e in dump.get("entries") or []:
        if e.get("is_p2p"):
            continue
        name, desc = e["process_group"]
        seq = int(e["collective_seq_id"])
        groups.setdefault(name, {})[seq] = Collective(
            seq=seq,
            op=e["profiling_name"].partition(":")[2] or e["profiling_name"],
            group=desc,
            elements=sum(math.prod(s) for s in e.get("input_sizes") or []),
            state=str(e.get("state")),
            created_ns=int(e.get("time_created_ns") or 0),
            frame=_user_frame(e.get("frames") or []),
        )
    states = {c.state for g in groups.values() for c in g.values()}
    return RankRecord(rank, groups, tracks_state=bool(states & {"started", "completed"}))


def _user_frame(frames: list[dict]) -> str | None:
    """The innermost frame outside torch (and the wrappers around its calls): the code that
    issued the collective."""
    for f in frames:
        path = str(f.get("filename", ""))
        if any(w in path for w in _WRAPPERS) or path.startswith(("torch/", "<")):
            continue
        tail = path.split("site-packages/")[-1] if "site-packages/" in path else path
        short = "/".join(tail.split("/")[-3:])
        return f"{short}:{f.get('line')} in {f.get('name')}"
    return None


def load(path: Path, rank: int) -> RankRecord:
    return record(parse(path.read_bytes()), rank)


def save(raws: list[bytes], path: Path, rank: int) -> RankRecord:
    """Write the first of torch's dumps (either format) that holds collectives as JSON, stacks
    included (a process has one recorder per backend kind: NCCL's, then gloo's), and return
    its record; nothing is written when none holds any."""
    dumps = [parse(raw) for raw in raws]
    dump = next((d for d in dumps if d.get("entries")), dumps[-1])
    if dump.get("entries"):  # an empty one: the recorder is off (hardware.flight_recorder=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dump, default=repr))
    return record(dump, rank)


def read_dir(log_dir: Path, ranks: Iterable[int]) -> dict[int, RankRecord]:
    """Every rank's record found in a run's logs: the one it wrote itself, else its watchdog's.
    A rank without one, or with one that cannot be read, is left out."""
    found = {}
    for rank in ranks:
        for path in (dump_file(log_dir, rank), Path(f"{watchdog_prefix(log_dir)}{rank}")):
            if path.is_file():
                try:
                    found[rank] = load(path, rank)
                    break
                except Exception:  # noqa: BLE001 - a damaged dump is no dump
                    continue
    return found


def describe(
    records: dict[int, RankRecord], expected: Iterable[int], waiting: Iterable[int] = ()
) -> str | None:
    """One line: per process group where the ranks stand (``waiting``: the ranks whose
    collective timed out), which rank is behind, or the collectives ranks entered under one
    sequence number (a mismatch); then the ``expected`` ranks that left no dump. None when the
    records show nothing pending."""
    names = sorted({g for r in records.values() for g in r.groups})
    waiting = frozenset(waiting)
    clauses = [c for name in names if (c := _describe_group(records, name, waiting))]
    if not clauses:
        return None
    missing = [r for r in expected if r not in records]
    if missing:
        clauses.append(
            f"no dump from {_ranks(missing)} (a stopped or killed rank cannot write one)"
        )
    return "flight recorder: " + "; ".join(clauses)


def _describe_group(
    records: dict[int, RankRecord], name: str, waiting: frozenset[int]
) -> str | None:
    now = {rank: c for rank, r in sorted(records.items()) if (c := r.current(name)) is not None}
    if mismatch := _mismatch(records, name):
        return mismatch
    seqs = {c.seq for c in now.values()}
    waits = {
        r
        for r in waiting & set(now)
        if records[r].newest_group() == name and now[r].state != "completed"
    }
    pending = any(records[r].tracks_state and c.state != "completed" for r, c in now.items())
    if len(seqs) == 1 and not waits and not pending:
        return None  # the ranks agree and none waits here: this group is not the hang
    by_place: dict[tuple, list[int]] = {}
    for rank, c in now.items():
        by_place.setdefault((-c.seq, c.op, rank in waits), []).append(rank)
    parts = []
    for (_, _, waiter), ranks in sorted(by_place.items()):
        c, tracked = now[ranks[0]], records[ranks[0]].tracks_state
        state = f", {c.state}" if tracked else ""
        if waiter:
            verb = "waits" if len(ranks) == 1 else "wait"
            parts.append(f"{_ranks(ranks)} {verb} in collective #{c.seq} ({c.what()}){state}")
        elif tracked and c.state != "completed":  # NCCL: the one it is stuck in
            verb = "is" if len(ranks) == 1 else "are"
            parts.append(f"{_ranks(ranks)} {verb} at collective #{c.seq} ({c.what()}){state}")
        else:
            parts.append(f"{_ranks(ranks)} last entered #{c.seq} ({c.what()}){state}")
    if min(seqs) < max(seqs):
        behind = [rank for rank, c in now.items() if c.seq == min(seqs)]
        parts[-1] += f": {_ranks(behind)} {'is' if len(behind) == 1 else 'are'} behind"
    return "; ".join(parts)


def _mismatch(records: dict[int, RankRecord], name: str) -> str | None:
    """The first sequence number under which ranks entered different collectives (op or
    sizes), among those every rank still holds."""
    held = [r.groups[name] for r in records.values() if name in r.groups]
    common = sorted(set.intersection(*(set(g) for g in held))) if len(held) > 1 else []
    for seq in common:
        at = {rank: r.groups[name][seq] for rank, r in sorted(records.items()) if name in r.groups}
        kinds: dict[tuple, list[int]] = {}
        for rank, c in at.items():
            kinds.setdefault((c.op, c.elements), []).append(rank)
        if len(kinds) > 1:
            c = next(iter(at.values()))
            listed = ", ".join(
                f"{_ranks(ranks)} {op} ({at[ranks[0]].what(group=False).partition(', ')[2]})"
                for (op, _), ranks in kinds.items()
            )
            return f"mismatch: ranks entered different collectives as #{seq} of {c.group}: {listed}"
    return None


def _ranks(ranks: list[int]) -> str:
    """rank 3, or ranks 0-2, 5 (consecutive ranks as a range)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return "ranks " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
