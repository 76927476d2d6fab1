"""What `fsdp-lab tune` says: its result, the table it prints, tune.json, and the one line when
nothing fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.config import HardwareKind
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.observe import rundir
from fsdp_lab.planning.tune_grid import Candidate
from fsdp_lab.planning.tune_probes import GIB, MIB, SAFETY, SLACK


@dataclass
class TuneResult:
    budget_bytes: int
    baseline_bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    keep_global_batch: bool = False
    winner: Candidate | None = None
    command: str | None = None
    order_errors: list[str] = field(default_factory=list)  # probes the model ranked wrong


def nothing_fits(
    candidates: list[Candidate],
    budget: int,
    world: int,
    device: HardwareKind,
    *,
    measured: bool,
) -> str:
    """Nothing fits: the smallest planned (or measured) peak, and what would help."""
    basis = "measured" if measured else "planned"

    def peak(c: Candidate) -> int | None:
        return c.measured_bytes if measured else c.planned_bytes

    smallest = min(candidates, key=lambda c: peak(c) or float("inf"))
    ways = ["more ranks (hardware.nproc_per_node / num_nodes: the state shards further)"]
    if not hardware_row(device).host:
        ways.append("offload=cpu")
    ways += ["a shorter trainer.seq_len", "a smaller model, or a larger --memory-gib"]
    return (
        f"nothing fits in {budget / GIB:g} GiB per rank on {world} rank(s): the smallest "
        f"{basis} peak is {(peak(smallest) or 0) / GIB:.2f} GiB ({smallest.name}); "
        f"try {', '.join(ways)}"
    )


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.0f}"


def tokens_per_s(c: Candidate) -> str:
    return "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f} tokens/s"


def format_table(result: TuneResult) -> str:
    rows = [
        ("candidate", "planned MiB", "measured MiB", "predicted tok/s", "measured tok/s",
         "measured/predicted", "verdict")
    ]  # fmt: skip
    order = sorted(result.candidates, key=lambda c: (c.measured_bytes is None, c.prior))
    for c in order:
        mark = "* " if c is result.winner else "  "
        rows.append(
            (
                mark + c.name,
                mib(c.planned_bytes),
                mib(c.measured_bytes),
                "-" if c.predicted_tokens_per_s is None else f"{c.predicted_tokens_per_s:,.0f}",
                "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f}",
                f"{c.tokens_per_s / c.predicted_tokens_per_s:.2f}x"
                if c.tokens_per_s and c.predicted_tokens_per_s
                else "-",
                c.verdict,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows)


def write_json(result: TuneResult, path: Path, overrides: list[str]) -> None:
    """tune.json: the budget, its basis, the winner and every candidate with its verdict."""
    record = {
        "overrides": overrides,
        "budget_bytes": result.budget_bytes,
        "baseline_bytes": result.baseline_bytes,
        "safety": SAFETY,
        "slack_bytes": SLACK,
        "keep_global_batch": result.keep_global_batch,
        "winner": result.winner.name if result.winner else None,
        "command": result.command,
        "order_errors": result.order_errors,
        "candidates": [
            {**dataclasses.asdict(c), "strategy": c.strategy.name, "ac": c.ac.name, "name": c.name}
            for c in result.candidates
        ],
    }
    rundir.write_json(path, record)
