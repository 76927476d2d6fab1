"""`fsdp-lab plan ... --device D --nodes N --compare KEY=V1,V2 ...`: the hardware a user is
about to rent, and one table over every combination of the compared settings, each with its
peak memory per rank and its predicted step (time, tokens/s per rank, MFU, and the split).

    fsdp-lab plan model=local model.name_or_path=DIR precision=bf16 --device h100 --nodes 8 \\
        --compare sharding=full,grad_op,hybrid activation_checkpointing=none,full
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from fsdp_lab.config import ConfigError
from fsdp_lab.config.device_rows import device_profile
from fsdp_lab.planning.plan import build_plan
from fsdp_lab.planning.time_model import TIME_HEADER, StepTime
from fsdp_lab.planning.tune_grid import override_key

GIB = 2**30


def with_device(overrides: list[str], device: str | None, nodes: int | None) -> list[str]:
    """The overrides with ``--nodes`` as hardware.num_nodes and, for a GPU ``--device``,
    hardware=gpu and its GPUs per node, where the overrides do not set them already."""
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes {nodes}: give the number of nodes, >= 1")
    keys = {override_key(o) for o in overrides}
    extra = []
    profile = device_profile(device) if device else None
    if profile is not None and profile.kind == "gpu" and not keys & {"hardware", "hardware.kind"}:
        extra.append("hardware=gpu")
    if profile is not None and "hardware.nproc_per_node" not in keys:
        extra.append(f"hardware.nproc_per_node={profile.ranks_per_node}")
    if nodes is not None:
        extra.append(f"hardware.num_nodes={nodes}")
    return [*extra, *overrides]


def _axes(compare: list[str]) -> list[list[str]]:
    """``KEY=V1,V2`` -> [KEY=V1, KEY=V2] per axis."""
    axes = []
    for item in compare:
        key, sep, values = item.partition("=")
        choices = [v for v in values.split(",") if v]
        if not sep or not key or not choices:
            raise ConfigError(
                f"--compare {item}: give KEY=V1,V2 (e.g. sharding=full,grad_op), one per setting"
            )
        axes.append([f"{key}={v}" for v in choices])
    return axes


@dataclass(frozen=True)
class Row:
    """One combination: its settings and its chosen strategy's peak and step, or why not."""

    settings: list[str]
    peak: int | None = None
    time: StepTime | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return {
            "settings": self.settings,
            "peak": self.peak,
            "time": self.time.to_json() if self.time else None,
            "error": self.error,
        }


def compare(overrides: list[str], axes: list[str], device: str | None) -> tuple[list[Row], str]:
    """Every combination's row, and the device priced on."""
    rows, device_name = [], None
    for combo in itertools.product(*_axes(axes)):
        try:
            plan = build_plan([*overrides, *combo], device)
        except ConfigError as e:
            rows.append(Row(list(combo), error=str(e)))
            continue
        chosen = plan.chosen_plan
        rows.append(Row(list(combo), peak=chosen.peak, time=chosen.time))
        device_name = plan.time_device
    return rows, device_name or str(device)


def print_compare(overrides: list[str], axes: list[str], device: str | None, *, as_json: bool):
    rows, device_name = compare(overrides, axes, device)
    if as_json:
        print(json.dumps({"device": device_name, "rows": [r.to_json() for r in rows]}, indent=2))
        return
    print(format_compare(rows, device_name))


def format_compare(rows: list[Row], device_name: str) -> str:
    timed = [r for r in rows if r.time is not None]
    best = min(timed, key=lambda r: r.time.step_s) if timed else None
    width = max(len(" ".join(r.settings)) for r in rows)
    lines = [
        f"predicted on {device_name}; * the fastest (peak: GiB per rank)",
        f"  {'settings':<{width}} {'peak':>7} {TIME_HEADER}",
    ]
    for r in rows:
        name = " ".join(r.settings)
        if r.error is not None:
            lines.append(f"  {name:<{width}} n/a: {r.error}")
            continue
        mark = "*" if r is best else " "
        lines.append(f"{mark} {name:<{width}} {r.peak / GIB:>7.2f} {r.time.cells()}")
    return "\n".join(lines)
