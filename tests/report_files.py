"""Reading what `fsdp-lab report` wrote: the table, the fixed line, the plots; and its CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import run_python

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_table(report: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(header, one {column: cell} per row) of the Markdown table in report.md."""
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    split = [[c.strip() for c in row.strip("| ").split(" | ")] for row in rows]
    header = split[0]
    return header, [dict(zip(header, cells, strict=True)) for cells in split[2:]]


def fixed_line(report: Path) -> str:
    return next(line for line in report.read_text().splitlines() if line.startswith("fixed: "))


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(path).shape  # decodes: a whole, valid PNG
    assert height > 100 and width > 100


def cli_report(sweep: Path) -> subprocess.CompletedProcess:
    return run_python(["-m", "fsdp_lab.tools.cli", "report", str(sweep)], timeout=120)
