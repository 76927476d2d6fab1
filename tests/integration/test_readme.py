"""The README's commands work as written.

Every command in the README's fenced ``bash``/``sh``/``shell``/``console`` blocks that starts with
``python train.py``, ``fsdp-lab``, ``make``, ``torchrun ... train.py`` or ``sbatch ... .sbatch`` is
checked:

- ``python train.py``: a few are run for real, shortened (2 steps, no evaluation, W&B and
  checkpoints off, a temporary run or sweep dir): the first single run and the first sweep this
  machine can run, one each, because the rest differ only in overrides. Every other one, and
  every one that needs what this machine lacks (a GPU, a TPU, SLURM, a prepared model, files,
  more ranks than cores, compilation), is composed with ``--cfg job``: Hydra builds the typed
  config and exits without running, so a misspelt group, option or field still fails. A sweep
  (``-m``) is composed once per swept value.
- ``torchrun``/``sbatch``: their ``train.py`` overrides are composed; the sbatch script must exist.
- ``fsdp-lab plan``: run (no device, no training); other ``fsdp-lab`` subcommands, whose arguments
  are paths to runs, must exist (``--help``).
- ``make``: each target must exist in the Makefile (nothing is run).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, check_ok, run_python, train

pytestmark = pytest.mark.slow  # runs of train.py: make test, not make test-fast

README = ROOT / "README.md"
FENCE_LANGS = {"bash", "sh", "shell", "console"}
# Recipes written alongside this test: until their YAML exists, their commands are skipped.
CONCURRENT_RECIPES = {"smollm2_shakespeare"}
# Appended to a real run: short, and nothing that reaches outside the run dir.
SHORT = (
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "logger=none",
    "checkpoint=none",
)
MAX_REAL_RUNS = 2  # the first single run and the first sweep
CORES = os.cpu_count() or 1
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|"}
# Overrides that name files or directories a fresh checkout does not have.
PATH_KEYS = {
    "resume",
    "model.name_or_path",
    "data.files",
    "data.tokenizer",
    "data.cache_dir",
    "hydra.run.dir",
    "hydra.sweep.dir",
}


# --- extraction -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    line: int  # the README line the command starts on
    text: str  # as written, continuation lines joined
    argv: tuple[str, ...]  # after leading VAR=value assignments, up to the first && ; | ||
    env: tuple[tuple[str, str], ...]  # those assignments

    @property
    def kind(self) -> str | None:
        a = self.argv
        if len(a) >= 2 and Path(a[0]).name in ("python", "python3") and a[1] == "train.py":
            return "train"
        if a and a[0] == "fsdp-lab":
            return "fsdp-lab"
        if a and a[0] == "make":
            return "make"
        if a and a[0] == "torchrun" and "train.py" in a:
            return "torchrun"
        if a and a[0] == "sbatch" and any(t.endswith(".sbatch") for t in a):
            return "sbatch"
        return None

    @property
    def id(self) -> str:
        words = [f"{k}={v}" for k, v in self.env] + list(self.argv)
        return f"L{self.line}:" + shlex.join(words)[:80]


def _logical_lines(block: list[tuple[int, str]], console: bool) -> list[tuple[int, str]]:
    """Join ``\\`` continuations; in a console block keep only ``$ `` lines (the rest is output)."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, raw in block:
        line = raw.rstrip()
        if pending is None:
            stripped = line.lstrip()
            if console:
                if not stripped.startswith("$ "):
                    continue
                stripped = stripped[2:]
            pending = (number, "")
            line = stripped
        start, text = pending
        if line.endswith("\\"):
            pending = (start, text + line[:-1] + " ")
            continue
        out.append((start, text + line))
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def extract_commands(markdown: str) -> list[Command]:
    """The commands of every fenced bash/sh/shell/console block, in order."""
    commands: list[Command] = []
    block: list[tuple[int, str]] | None = None
    lang = ""
    for number, line in enumerate(markdown.splitlines(), start=1):
        fence = re.match(r"^\s*(```|~~~)\s*([\w+-]*)", line)
        if fence:
            if block is None:
                lang, block = fence.group(2).lower(), []
            else:
                if lang in FENCE_LANGS:
                    for start, text in _logical_lines(block, console=lang == "console"):
                        commands.extend(_parse(start, text))
                block = None
            continue
        if block is not None:
            block.append((number, line))
    assert block is None, "README: a fenced block is never closed"
    return [c for c in commands if c.kind is not None]


def _parse(line: int, text: str) -> list[Command]:
    if not text.strip() or text.lstrip().startswith("#"):
        return []
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:  # unbalanced quotes: a broken command, shown as one that fails
        return [Command(line, text.strip(), ("python", "train.py", f"<unparsable: {e}>"), ())]
    commands = []
    for is_sep, group in itertools.groupby(tokens, key=lambda t: t in SEPARATORS):
        if is_sep:
            continue
        group = list(group)
        env = []
        while group and ENV_ASSIGNMENT.match(group[0]):
            key, _, value = group.pop(0).partition("=")
            env.append((key, value))
        if group:
            commands.append(Command(line, text.strip(), tuple(group), tuple(env)))
    return commands


# --- overrides --------------------------------------------------------------------------------


def override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def override_value(override: str) -> str:
    return override.partition("=")[2]


def split_top_level(value: str) -> list[str]:
    """``a,b,[c,d]`` -> ``a``, ``b``, ``[c,d]``: a sweep's values (commas inside brackets stay)."""
    parts, depth, current = [], 0, ""
    for ch in value:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def merge(overrides: list[str], forced: tuple[str, ...]) -> list[str]:
    """``overrides`` with ``forced`` appended, dropping any of the former for the same key."""
    keys = {override_key(o) for o in forced}
    return [o for o in overrides if override_key(o) not in keys] + list(forced)


@dataclass(frozen=True)
class TrainArgs:
    overrides: tuple[str, ...]
    multirun: bool
    show_cfg: bool  # the command itself is ``--cfg ...``


def train_args(argv: tuple[str, ...]) -> TrainArgs:
    """The overrides of ``... train.py ARGS`` (flags set aside, README ellipses dropped)."""
    args = list(argv[argv.index("train.py") + 1 :])
    multirun = show_cfg = False
    overrides = []
    while args:
        a = args.pop(0)
        if a in ("-m", "--multirun"):
            multirun = True
        elif a in ("--cfg", "-c"):
            show_cfg = True
            if args:
                args.pop(0)
        elif a in ("...", "…"):
            continue
        else:
            overrides.append(a)
    return TrainArgs(tuple(overrides), multirun, show_cfg)


def experiment_of(overrides) -> str | None:
    for o in overrides:
        if override_key(o) == "experiment":
            return override_value(o)
    return None


def why_not_run_here(overrides: tuple[str, ...], multirun: bool) -> str | None:
    """Why a ``python train.py`` command is composed rather than run here (None: it can run)."""
    values = {override_key(o): override_value(o) for o in overrides}
    if values.get("hardware") in ("gpu", "tpu"):
        return f"hardware={values['hardware']}"
    if values.get("hydra/launcher", "basic") != "basic":
        return f"hydra/launcher={values['hydra/launcher']}"
    experiment = values.get("experiment")
    if experiment:  # recipes are full-size runs (and may need a GPU or a prepared model)
        return f"experiment={experiment}"
    for key in PATH_KEYS - {"hydra.run.dir", "hydra.sweep.dir"}:
        if key in values:
            return f"{key} names a path"
    if values.get("model") == "local":
        return "model=local needs a model directory"
    if values.get("data") == "hub":
        return "data=hub needs the hub"
    if values.get("compile") == "true":
        return "compile=true compiles for minutes here"
    if any("$" in o for o in overrides):
        return "a shell variable"
    nproc = values.get("hardware.nproc_per_node")
    if nproc and nproc.isdigit() and int(nproc) > CORES:
        return f"{nproc} ranks on {CORES} cores"
    if any(
        override_key(o).startswith("hardware.num_nodes") and override_value(o) != "1"
        for o in overrides
    ):
        return "several nodes"
    return None


def skip_if_recipe_missing(overrides) -> None:
    experiment = experiment_of(overrides)
    if (
        experiment in CONCURRENT_RECIPES
        and not (ROOT / "conf" / "experiment" / f"{experiment}.yaml").is_file()
    ):
        pytest.skip(
            f"conf/experiment/{experiment}.yaml is being written concurrently; not there yet"
        )


# --- running ----------------------------------------------------------------------------------


def _run(argv: list[str], env=(), timeout: int = 300) -> subprocess.CompletedProcess:
    """``python *argv[1:]`` (``argv[0]`` is this Python) with the README's variables set."""
    assert argv[0] == sys.executable, argv
    return run_python(argv[1:], env=dict(env), timeout=timeout)


def compose(overrides, multirun: bool, env=()) -> None:
    """``python train.py OVERRIDES --cfg job``; a sweep once per swept value."""
    skip_if_recipe_missing(overrides)
    overrides = [
        o for o in overrides if override_key(o) not in ("hydra.run.dir", "hydra.sweep.dir")
    ]
    variants = [overrides]
    if multirun:
        swept = {
            i: split_top_level(override_value(o))
            for i, o in enumerate(overrides)
            if "=" in o and len(split_top_level(override_value(o))) > 1
        }
        first = [
            f"{override_key(o)}={swept[i][0]}" if i in swept else o for i, o in enumerate(overrides)
        ]
        variants = [first]
        for i, values in swept.items():
            for value in values[1:]:
                variants.append(
                    [*first[:i], f"{override_key(overrides[i])}={value}", *first[i + 1 :]]
                )
    for variant in variants:
        proc = _run([sys.executable, "train.py", *variant, "--cfg", "job"], env, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip(), (
            f"`python train.py {shlex.join(variant)} --cfg job` does not compose "
            f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )


def fsdp_lab_argv() -> list[str]:
    """The ``fsdp-lab`` console script of this checkout's pyproject.toml, run by this Python."""
    entry = re.search(
        r'^fsdp-lab\s*=\s*"([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert entry, "pyproject.toml declares no fsdp-lab script"
    module, func = entry.groups()
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.%/-]+(?:\s+[A-Za-z0-9_.%/-]+)*)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


# --- what to check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    command: Command
    mode: str  # run | compose | plan | cli | make | sbatch | torchrun
    reason: str = ""


def plan_checks(commands: list[Command]) -> list[Check]:
    checks, seen, real = [], set(), {"single": False, "multirun": False}
    for c in commands:
        if c.argv in seen:
            continue
        seen.add(c.argv)
        match c.kind:
            case "train":
                args = train_args(c.argv)
                why = why_not_run_here(args.overrides, args.multirun)
                slot = "multirun" if args.multirun else "single"
                if args.show_cfg:
                    checks.append(Check(c, "compose", "--cfg"))
                elif why is None and not real[slot] and sum(real.values()) < MAX_REAL_RUNS:
                    real[slot] = True
                    checks.append(Check(c, "run"))
                else:
                    checks.append(Check(c, "compose", why or f"another {slot} run is run"))
            case "fsdp-lab":
                checks.append(Check(c, "plan" if c.argv[1:2] == ("plan",) else "cli"))
            case kind:
                checks.append(Check(c, kind))
    return checks


COMMANDS = extract_commands(README.read_text())
CHECKS = plan_checks(COMMANDS)


def _param(check: Check):
    marks = [pytest.mark.slow] if check.mode == "run" else []
    return pytest.param(check, id=f"{check.mode}-{check.command.id}", marks=marks)


@pytest.mark.parametrize("check", [_param(c) for c in CHECKS])
def test_readme_command(check: Check, tmp_path):
    c = check.command
    match check.mode:
        case "make":
            targets = [t for t in c.argv[1:] if not t.startswith("-") and "=" not in t]
            assert targets, f"README line {c.line}: `{c.text}` names no target"
            missing = set(targets) - makefile_targets()
            assert not missing, f"README line {c.line}: no Makefile target {sorted(missing)}"
        case "plan":
            proc = _run([*fsdp_lab_argv(), *c.argv[1:]], c.env, timeout=120)
            check_ok(proc)
            assert "per rank" in proc.stdout, proc.stdout
        case "cli":
            assert len(c.argv) > 1, f"README line {c.line}: `fsdp-lab` without a subcommand"
            proc = _run([*fsdp_lab_argv(), c.argv[1], "--help"], c.env, timeout=60)
            assert proc.returncode == 0, (
                f"README line {c.line}: `fsdp-lab {c.argv[1]}` is not a subcommand:\n{proc.stderr}"
            )
        case "sbatch":
            i = next(i for i, t in enumerate(c.argv) if t.endswith(".sbatch"))
            assert (ROOT / c.argv[i]).is_file(), f"README line {c.line}: no {c.argv[i]}"
            compose(c.argv[i + 1 :], multirun=False, env=c.env)
        case "torchrun":
            compose(train_args(c.argv).overrides, multirun=False, env=c.env)
        case "compose":
            args = train_args(c.argv)
            if args.show_cfg:  # the README's own --cfg: run it as written
                skip_if_recipe_missing(args.overrides)
                proc = _run([sys.executable, *c.argv[1:]], c.env, timeout=120)
                check_ok(proc)
            else:
                compose(args.overrides, args.multirun, c.env)
        case "run":
            args = train_args(c.argv)
            if args.multirun:
                _run_sweep(args.overrides, tmp_path / "sweep", c.env)
            else:
                _run_single(args.overrides, tmp_path / "run")
        case _:
            raise AssertionError(check.mode)


def _run_single(overrides, run_dir: Path) -> None:
    """conftest's ``train``: the README's overrides, shortened, into a temporary run dir."""
    proc = train(
        run_dir, *merge(list(overrides), (*SHORT, f"hydra.run.dir={run_dir}")), timeout=300
    )
    check_ok(proc)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"


def _run_sweep(overrides, sweep_dir: Path, env) -> None:
    """The sweep with each swept key at its first value (one job; the others are composed)."""
    first = [
        f"{override_key(o)}={split_top_level(override_value(o))[0]}" if "=" in o else o
        for o in overrides
    ]
    compose(overrides, multirun=True, env=env)  # every swept value still composes
    proc = _run(
        [
            sys.executable,
            "train.py",
            "-m",
            *merge(first, (*SHORT, f"hydra.sweep.dir={sweep_dir}")),
        ],
        env,
        timeout=300,
    )
    check_ok(proc)
    assert json.loads((sweep_dir / "0" / "run.json").read_text())["status"] == "completed"
    assert (sweep_dir / "report.md").is_file(), "the sweep wrote no report.md"


# --- the test itself ---------------------------------------------------------------------------


def test_the_readme_has_its_commands():
    kinds = {(c.kind, c.argv[1] if c.kind == "fsdp-lab" else None) for c in COMMANDS}
    assert ("fsdp-lab", "plan") in kinds
    make_targets = {t for c in COMMANDS if c.kind == "make" for t in c.argv[1:]}
    assert {"train", "test", "test-fast"} <= make_targets, make_targets
    runs = [train_args(c.argv) for c in COMMANDS if c.kind == "train"]
    assert any(a.multirun for a in runs) and sum(not a.multirun for a in runs) >= 3
    assert [c.mode for c in CHECKS].count("run") == MAX_REAL_RUNS, CHECKS


def test_extraction():
    md = "\n".join(
        [
            "text `python train.py not=this`",
            "```bash",
            "make train        # a comment",
            "PJRT_DEVICE=CPU python train.py hardware=tpu \\",
            "    precision=bf16   # continued",
            "python -m venv v && make test",
            "pip install x",
            "```",
            "```console",
            "$ fsdp-lab plan sharding=hybrid",
            "LlamaForCausalLM: output, not a command",
            "```",
            "```python",
            "make nothing",
            "```",
        ]
    )
    got = [(c.line, c.argv, c.env) for c in extract_commands(md)]
    assert got == [
        (3, ("make", "train"), ()),
        (4, ("python", "train.py", "hardware=tpu", "precision=bf16"), (("PJRT_DEVICE", "CPU"),)),
        (6, ("make", "test"), ()),
        (10, ("fsdp-lab", "plan", "sharding=hybrid"), ()),
    ]


def test_a_misspelt_command_fails():
    """The checks can fail: a misspelt group, a misspelt swept option, a missing make target."""
    with pytest.raises(AssertionError, match="does not compose"):
        compose(("shardng=full",), multirun=False)
    with pytest.raises(AssertionError, match="does not compose"):
        compose(("sharding=full,grad_opp",), multirun=True)
    (check,) = plan_checks(extract_commands("```sh\nmake tset\n```"))
    with pytest.raises(AssertionError, match="no Makefile target"):
        test_readme_command(check, None)
