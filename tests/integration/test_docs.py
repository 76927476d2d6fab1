"""The commands of the README and of every docs/*.md work as written.

Every command of a fenced ``bash``/``sh``/``shell``/``console`` block (an untagged block whose
lines start with ``$ `` is a console), and every inline code span that starts with a command,
is found and checked; a command this test does not recognise fails it, so none goes unchecked:

- ``python train.py`` (also under ``torchrun``, ``srun`` and ``sbatch SCRIPT.sbatch``): composed
  in this process by Hydra from this checkout's conf/, typed and checked by the config's rules
  against the ranks the command describes (a GPU or TPU run is composed here too: the rules need
  no device), every value of a sweep once. Two are also run for real, shortened: the first
  single run and the first sweep this machine can run; the rest differ only in overrides.
- a console command followed by ``fsdp_lab: error: ...`` must fail with that error.
- ``fsdp-lab``: parsed by the CLI's own parser, its overrides composed; ``plan`` is run (no
  device); the other subcommands need what the docs name by path (NOT_RUN says why, each).
- inline spans (prose, with placeholders such as ``CKPT``): the subcommand and its flags exist,
  ``train.py``'s overrides compose.
- ``make``: the targets exist; ``python SCRIPT.py``/``python -m MODULE``: they exist;
  ``pip install -e ".[extra]"``: the extras exist; shell lines (SHELL_WORDS) are recognised.

Nothing here needs editing when a config group, option or doc is added: conf/ and docs/ are
read at test time.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, check_ok, run_python, train
from doc_commands import (
    ERROR_PREFIXES,
    FENCE_LANGS,
    Command,
    TrainArgs,
    blocks,
    extract_commands,
    is_console,
    merge,
    override_key,
    override_value,
    train_args,
)

pytestmark = pytest.mark.slow  # runs of train.py: make test, not make test-fast

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# fsdp-lab subcommands parsed and composed but not run here, and why; `plan` is run.
NOT_RUN = {
    "export": "needs a run's checkpoint, which the docs name by path",
    "verify": "needs a run's checkpoint, which the docs name by path",
    "report": "needs a sweep's directory, which the docs name by path",
    "tune": "probes several real runs (minutes)",
    "calibrate": "measures this machine for 30 s (tests/unit/planning/test_calibrate.py)",
    "from-accelerate": "needs accelerate's YAML, which the docs name by path",
    "data": "tokenises a corpus the docs name by path",
    "profile": "needs a profiled run's traces, which the docs name by path",
    "eval": "needs a run's export or a model directory, which the docs name by path",
}
# Commands skipped (pytest shows each with its reason): only what cannot even be composed here,
# such as an example that names a config the reader writes first. Keyed by the start of the
# command's words (``shlex.join(argv)``), so that edits around it do not move the key; an entry
# that matches no command fails test_skips_name_commands.
SKIP: dict[str, str] = {
    "python train.py 'logger=[wandb,csv]'": "the docs' example tracker: its module and YAML are "
    "the reader's to write (tests/integration/test_trackers.py runs one written by the test)",
    "fsdp-lab train --config-dir my_experiments/conf": "the reader's own config dir "
    "(tests/integration/test_wheel.py runs one written by the test)",
    "fsdp-lab plan --config-dir my_experiments/conf": "the reader's own config dir",
    "fsdp-lab tune --config-dir my_experiments/conf": "the reader's own config dir",
}
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
# Ranks per node where neither the command nor its config says (no device is asked here).
ASSUMED_NPROC = {"gpu": 8, "tpu": 4, "cpu": 2}  # a GPU node, a v4-8 TPU VM, train.py's CPU
# Overrides that name files or directories a fresh checkout does not have.
PATH_KEYS = {"resume", "model.name_or_path", "data.files", "data.tokenizer", "data.cache_dir"}


# --- which run here ---------------------------------------------------------------------------


def why_not_run_here(overrides: tuple[str, ...]) -> str | None:
    """Why a ``python train.py`` command is only composed here (None: it can run)."""
    values = {override_key(o): override_value(o) for o in overrides}
    if values.get("hardware") in ("gpu", "tpu"):
        return f"hardware={values['hardware']}"
    if values.get("hydra/launcher", "basic") != "basic":
        return f"hydra/launcher={values['hydra/launcher']}"
    if values.get("experiment"):  # recipes are full-size runs (and may need a GPU or a model)
        return f"experiment={values['experiment']}"
    if values.get("hparams_search"):
        return f"hparams_search={values['hparams_search']} runs a study of many trials"
    for key in PATH_KEYS & set(values):
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
    if values.get("hardware.num_nodes", "1") != "1":
        return "several nodes"
    return None


# --- composing, in this process ---------------------------------------------------------------


def expand(override: str) -> str:
    """A shell variable (``$HOME``, ``$MODEL``) as a path: composition reads no files."""
    return re.sub(r"\$\{?(\w+)\}?", r"/path/to/\1", override)


def sweep_variants(overrides) -> tuple[list[list[str]], bool]:
    """Each swept key at its first value, then each other value of each swept key in turn; an
    interval (an Optuna search space) at its start. True if any key is swept."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values, swept = [], False
    for o in OverridesParser.create().parse_overrides([expand(o) for o in overrides]):
        swept = swept or o.is_sweep_override()
        if not o.is_sweep_override():
            values.append([o.input_line])
        elif o.is_interval_sweep():
            values.append([f"{o.get_key_element()}={o.value().start}"])
        else:
            values.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
    first = [v[0] for v in values]
    out = [first]
    for i, vs in enumerate(values):
        out.extend([*first[:i], v, *first[i + 1 :]] for v in vs[1:])
    return out, swept


def hydra_compose(overrides: list[str]):
    """Hydra's config of ``python train.py OVERRIDES`` from this checkout's conf/: (the job's
    config, Hydra's own node with its launcher and sweeper resolved)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from fsdp_lab.config import register_schema
    from fsdp_lab.config.model import is_hub_id

    register_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="docs"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    hydra_node = cfg.hydra
    launcher = OmegaConf.to_container(hydra_node.launcher, resolve=True)
    with open_dict(cfg):
        del cfg["hydra"]
    name = cfg.model.name_or_path
    if name and not is_hub_id(name) and not Path(name).expanduser().exists():
        cfg.model.name_or_path = str(stand_in_model())
    return cfg, hydra_node, launcher


@functools.cache
def stand_in_model() -> Path:
    """A model directory the docs name by path (``/models/SmolLM2-135M``, ``$MODEL``, a
    recipe's prepared model) stands in as an empty one with a config.json: composing checks
    only that the file is there, and a fresh checkout has no such directory."""
    path = Path(tempfile.mkdtemp(prefix="fsdp_lab_docs_model_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (path / "config.json").write_text("{}")
    return path


def topology(cfg, args: TrainArgs, env: dict):
    """The ranks the command describes: its launcher's, else its hardware group's, else a
    typical node's (ASSUMED_NPROC); hardware=auto is the CPU path, the one the docs show."""
    from fsdp_lab.config import HardwareKind
    from fsdp_lab.config.topology import Topology

    h = cfg.hardware
    kind = HardwareKind.cpu if h.kind is HardwareKind.auto else h.kind
    nproc = args.nproc or h.nproc_per_node
    if nproc is None and kind is HardwareKind.tpu and "CPU_NUM_DEVICES" in env:
        nproc = int(env["CPU_NUM_DEVICES"])
    nproc = nproc or ASSUMED_NPROC[kind.name]
    nodes = args.nodes or h.num_nodes
    return Topology(world_size=nproc * nodes, nproc_per_node=nproc, num_nodes=nodes, device=kind)


def _check_slurm_launcher(cfg) -> None:
    """launch.slurm's check of hydra/launcher=slurm, with a ``sinfo`` that lists the partition
    asked for (there is no cluster here)."""
    import subprocess
    from unittest import mock

    from fsdp_lab.launch import slurm

    h = cfg.hardware
    fake = types.SimpleNamespace(
        run=lambda *a, **k: types.SimpleNamespace(stdout=h.partition or ""),
        SubprocessError=subprocess.SubprocessError,
    )
    with mock.patch.object(slurm, "subprocess", fake):
        slurm.check_launcher(h.kind, h.nproc_per_node, h.partition)


def validated(overrides, args: TrainArgs, env: dict, *, deep: bool = False):
    """Every variant of the command composed, typed and checked against its ranks (``deep``:
    also the model and data checks train.py makes before any rank starts); raises the first
    ConfigError, Hydra's or OmegaConf's error."""
    from hydra.types import RunMode

    from fsdp_lab.config import to_typed
    from fsdp_lab.config.rules import validate

    variants, swept = sweep_variants(overrides)
    for variant in variants:
        cfg, hydra_node, launcher = hydra_compose(variant)
        if swept and not args.multirun and hydra_node.mode != RunMode.MULTIRUN:
            raise ValueError(f"{shlex.join(variant)}: a sweep without -m")
        typed = to_typed(cfg)
        topo = topology(typed, args, env)
        validate(typed, topo)
        if "submitit" in str(launcher.get("_target_", "")):
            _check_slurm_launcher(typed)
        if deep:
            from fsdp_lab.launch.prepare import check_model_and_data

            check_model_and_data(typed, topo)


def compose(c: Command, args: TrainArgs | None = None) -> None:
    """Fails, naming the doc's line, where the command's train.py arguments do not compose."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fsdp_lab.config import ConfigError

    args = args or train_args(c)
    try:
        validated(args.overrides, args, dict(c.env))
    except (ConfigError, HydraException, OmegaConfBaseException, ValueError) as e:
        raise AssertionError(
            f"{c.where}: `{c.text}` does not compose: {type(e).__name__}: {e}\n(an example "
            "of a config the reader writes first? give SKIP the command and the reason)"
        ) from None


# --- fsdp-lab ---------------------------------------------------------------------------------


def cli_parser() -> argparse.ArgumentParser:
    """fsdp-lab's parser, built as ``fsdp_lab.tools.cli.main`` builds it."""
    from fsdp_lab.tools import cli

    parser = argparse.ArgumentParser(prog="fsdp-lab")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, _) in cli.COMMANDS.items():
        add(sub, name)
    return parser


def parse_cli(c: Command) -> argparse.Namespace:
    """The command's arguments as fsdp-lab parses them; fails with the parser's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli_parser().parse_args(list(c.argv[1:]))
    except SystemExit:
        raise AssertionError(f"{c.where}: `{c.text}`: {err.getvalue().strip()}") from None


def _subparser(parser: argparse.ArgumentParser, words) -> tuple[argparse.ArgumentParser, list]:
    """The (sub)parser the leading words select, and the words after them."""
    words = list(words)
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser = subs[0].choices[words.pop(0)]
    return parser, words


def check_mention(c: Command) -> None:
    """An inline ``fsdp-lab SUB [--flag ...] PLACEHOLDERS``: the subcommand and flags exist."""
    parser, rest = _subparser(cli_parser(), c.argv[1:])
    assert parser.prog != "fsdp-lab" or len(c.argv) == 1, (
        f"{c.where}: `{c.text}`: no subcommand {c.argv[1]!r}"
    )
    flags = {t.split("=")[0] for t in rest if t.startswith("-")}
    missing = flags - set(parser._option_string_actions)
    assert not missing, f"{c.where}: `{c.text}`: {parser.prog} has no {sorted(missing)}"


def can_plan(overrides) -> bool:
    """``fsdp-lab plan`` reads no files: a command naming one is composed instead."""
    values = {override_key(o): override_value(o) for o in overrides}
    return not (
        PATH_KEYS & set(values)
        or values.get("model") == "local"
        or values.get("hardware") == "tpu"
        or any("$" in o for o in overrides)
    )


def run_plan(c: Command) -> None:
    from fsdp_lab.tools import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(c.argv[1:]))
    assert code == 0, f"{c.where}: `{c.text}` exits {code}:\n{err.getvalue()}"
    assert "per rank" in out.getvalue(), out.getvalue()
    printed = {figures_masked(line) for line in out.getvalue().splitlines()}
    stale = [o for o in c.output if o != "..." and figures_masked(o) not in printed]
    assert not stale, f"{c.where}: `{c.text}` no longer prints, figures aside:\n" + "\n".join(stale)


def figures_masked(line: str) -> str:
    """A line of output with its numbers as ``#`` and its spaces as one: the shown output must
    keep its lines and their shape; its figures may move (the memory model is refined) without
    failing the docs."""
    return " ".join(re.sub(r"\d[\d,.]*", "#", line).split())


def check_cli(c: Command) -> None:
    """Parsed, and its overrides (if it takes any) composed."""
    ns = parse_cli(c)
    assert c.argv[1] in NOT_RUN or c.argv[1] == "plan", (
        f"{c.where}: `fsdp-lab {c.argv[1]}` is neither run here nor in NOT_RUN with a reason"
    )
    if getattr(ns, "overrides", None) is not None:
        compose(c, TrainArgs(tuple(ns.overrides)))


# --- the rest ---------------------------------------------------------------------------------


def makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.%/-]+(?:\s+[A-Za-z0-9_.%/-]+)*)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def check_make(c: Command) -> None:
    targets = [t for t in c.argv[1:] if not t.startswith("-") and "=" not in t]
    assert targets, f"{c.where}: `{c.text}` names no target"
    missing = set(targets) - makefile_targets()
    assert not missing, f"{c.where}: no Makefile target {sorted(missing)}"


def check_pip(c: Command) -> None:
    """``pip install -e ".[a,b]"`` / ``'fsdp_lab[a]'``: the extras exist in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    section = text.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, re.MULTILINE))
    for t in c.argv[2:]:
        m = re.fullmatch(r"(?:\.|fsdp_lab|fsdp-lab)\[([\w,-]+)\]", t)
        if m:
            missing = set(m.group(1).split(",")) - set(extras)
            assert not missing, f"{c.where}: pyproject.toml has no extra {sorted(missing)}"


def expect_error(c: Command) -> None:
    """A console command shown failing: it fails, before any rank starts, with that error
    (the shown line may end in ``...``)."""
    from fsdp_lab.config import ConfigError

    shown = c.error
    for prefix in ERROR_PREFIXES:
        shown = shown.removeprefix(prefix)
    args = train_args(c)
    try:
        validated(args.overrides, args, dict(c.env), deep=True)
    except ConfigError as e:
        assert str(e).startswith(shown.split("...")[0].rstrip()), (
            f"{c.where}: `{c.text}` fails otherwise than shown:\n  shown: {shown}\n  got:   {e}"
        )
    else:
        raise AssertionError(f"{c.where}: `{c.text}` does not fail; the doc shows: {c.error}")


# --- what to check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    command: Command
    mode: str  # run | compose | fail | plan | cli | mention | make | script | module | pip | skip
    reason: str = ""


def skip_reason(c: Command) -> str | None:
    words = shlex.join(c.argv)
    return next((why for key, why in SKIP.items() if words.startswith(key)), None)


def _train_mode(c: Command, real: dict[str, bool]) -> tuple[str, str]:
    """run, compose or fail, and why not run (a real run for the first of each kind only)."""
    if c.error:
        return "fail", "shown failing"
    args = train_args(c)
    if c.inline or c.kind != "train" or Path(c.argv[0]).name not in ("python", "python3"):
        return "compose", "a launcher or a mention"
    if args.show_cfg:
        return "compose", "--cfg"
    why = why_not_run_here(args.overrides)
    slot = "multirun" if args.multirun else "single"
    if why is None and not real[slot]:
        real[slot] = True
        return "run", ""
    return "compose", why or f"another {slot} run is run"


def plan_checks(commands: list[Command]) -> list[Check]:
    checks, seen, real = [], set(), {"single": False, "multirun": False}
    for c in commands:
        if (c.argv, c.env, c.inline, c.error) in seen:
            continue
        seen.add((c.argv, c.env, c.inline, c.error))
        if skip_reason(c):
            checks.append(Check(c, "skip", skip_reason(c)))
            continue
        match c.kind:
            case "train" | "sbatch":
                checks.append(Check(c, *_train_mode(c, real)))
            case "fsdp-lab" if c.inline:
                checks.append(Check(c, "mention"))
            case "fsdp-lab" if c.argv[1:2] == ("plan",):
                try:
                    plan = can_plan(parse_cli(c).overrides)
                except AssertionError:  # does not parse: its check says so
                    plan = False
                checks.append(Check(c, "plan" if plan else "cli", "" if plan else "names a path"))
            case "fsdp-lab":
                checks.append(Check(c, "cli", NOT_RUN.get(c.argv[1], "")))
            case "make" | "script" | "module" | "pip" as mode:
                checks.append(Check(c, mode))
            case _:  # shell lines: recognised; unknown ones fail test_every_command_is_known
                pass
    return checks


COMMANDS = [
    c for doc in DOCS for c in extract_commands(doc.read_text(), str(doc.relative_to(ROOT)))
]
CHECKS = plan_checks(COMMANDS)


def _param(check: Check):
    return pytest.param(check, id=f"{check.mode}-{check.command.id}")


@pytest.mark.parametrize("check", [_param(c) for c in CHECKS])
def test_doc_command(check: Check, tmp_path):
    c = check.command
    match check.mode:
        case "skip":
            pytest.skip(f"{c.where}: {check.reason}")
        case "compose":
            args = train_args(c)
            if args.script:
                assert (ROOT / args.script).is_file(), f"{c.where}: no {args.script}"
            compose(c, args)
        case "fail":
            expect_error(c)
        case "run":
            args = train_args(c)
            compose(c, args)  # every swept value composes; the first is run
            if args.multirun:
                _run_sweep(args.overrides, tmp_path / "sweep", c.env)
            else:
                _run_single(args.overrides, tmp_path / "run")
        case "plan":
            run_plan(c)
        case "cli":
            check_cli(c)
        case "mention":
            check_mention(c)
        case "make":
            check_make(c)
        case "script":
            assert (ROOT / c.argv[1]).is_file(), f"{c.where}: no {c.argv[1]}"
        case "module":
            assert importlib.util.find_spec(c.argv[2]), f"{c.where}: no module {c.argv[2]}"
        case "pip":
            check_pip(c)
        case _:
            raise AssertionError(check.mode)


def _run_single(overrides, run_dir: Path) -> None:
    """conftest's ``train``: the doc's overrides, shortened, into a temporary run dir."""
    proc = train(
        run_dir, *merge(list(overrides), (*SHORT, f"hydra.run.dir={run_dir}")), timeout=300
    )
    check_ok(proc)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"


def _run_sweep(overrides, sweep_dir: Path, env) -> None:
    """The sweep with each swept key at its first value (one job; the others are composed)."""
    first = sweep_variants(overrides)[0][0]
    proc = run_python(
        ["train.py", "-m", *merge(first, (*SHORT, f"hydra.sweep.dir={sweep_dir}"))],
        env=dict(env),
        timeout=300,
    )
    check_ok(proc)
    assert json.loads((sweep_dir / "0" / "run.json").read_text())["status"] == "completed"
    assert (sweep_dir / "report.md").is_file(), "the sweep wrote no report.md"


# --- the test itself ---------------------------------------------------------------------------


def test_every_command_is_known():
    unknown = [f"{c.where}: `{c.text}`" for c in COMMANDS if c.kind is None]
    assert not unknown, (
        "commands this test cannot check; add a check, or their first word to SHELL_WORDS:\n"
        + "\n".join(unknown)
    )


def test_no_command_hides_in_an_untagged_block():
    """A command in a block that is neither a command block nor a console would go unchecked."""
    hidden = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
        for doc in DOCS
        for lang, block in blocks(doc.read_text())
        if lang != "prose" and lang not in FENCE_LANGS and not is_console(lang, block)
        for n, line in block
        if re.match(r"\s*(python3? train\.py|fsdp-lab|torchrun|sbatch) ", line)
    ]
    assert not hidden, "tag these blocks ```bash (or write them as `$ ` console lines):\n" + (
        "\n".join(hidden)
    )


def test_skips_name_commands():
    words = [shlex.join(c.argv) for c in COMMANDS]
    stale = [key for key in SKIP if not any(w.startswith(key) for w in words)]
    assert not stale, f"SKIP names no command of the docs: {stale}"


def test_the_docs_have_their_commands():
    readme = [c for c in COMMANDS if c.doc == "README.md" and not c.inline]
    assert ("fsdp-lab", "plan") in {c.argv[:2] for c in readme}
    make_targets = {t for c in readme if c.kind == "make" for t in c.argv[1:]}
    assert {"train", "test", "test-fast"} <= make_targets, make_targets
    runs = [train_args(c) for c in readme if c.kind == "train"]
    assert any(a.multirun for a in runs) and sum(not a.multirun for a in runs) >= 3
    assert [c.mode for c in CHECKS].count("run") == MAX_REAL_RUNS, CHECKS
    assert {c.doc for c in COMMANDS} >= {"README.md", "docs/experiments-and-wandb.md"}
    assert any(c.mode == "fail" for c in CHECKS), "troubleshooting.md's errors are not found"


def test_extraction():
    md = "\n".join(
        [
            "text `python train.py hardware=tpu` and `sharding=hybrid`, `fsdp-lab verify CKPT`",
            "```bash",
            "make train        # a comment",
            "PJRT_DEVICE=CPU python train.py hardware=tpu \\",
            "    precision=bf16   # continued",
            "python -m venv v && make test",
            "MODEL=$(python scripts/prepare_smollm2.py | tail -1)",
            "```",
            "```console",
            "$ fsdp-lab plan sharding=hybrid",
            "LlamaForCausalLM: output, not a command",
            "$ python train.py sharding=hybrid",
            "fsdp_lab: error: sharding=hybrid on 2 ranks ...",
            "```",
            "```",
            "$ make lint",
            "```",
            "```python",
            "make nothing",
            "```",
        ]
    )
    got = [(c.line, c.argv, c.env, c.inline, c.error) for c in extract_commands(md)]
    assert got == [
        (3, ("make", "train"), (), False, None),
        (
            4,
            ("python", "train.py", "hardware=tpu", "precision=bf16"),
            (("PJRT_DEVICE", "CPU"),),
            False,
            None,
        ),
        (6, ("python", "-m", "venv", "v"), (), False, None),
        (6, ("make", "test"), (), False, None),
        (7, ("python", "scripts/prepare_smollm2.py"), (), False, None),
        (7, ("tail", "-1"), (), False, None),
        (10, ("fsdp-lab", "plan", "sharding=hybrid"), (), False, None),
        (12, ("python", "train.py", "sharding=hybrid"), (), False, md.splitlines()[12]),
        (16, ("make", "lint"), (), False, None),
        (1, ("python", "train.py", "hardware=tpu"), (), True, None),
        (1, ("fsdp-lab", "verify", "CKPT"), (), True, None),
    ]


def test_a_misspelt_command_fails():
    """The checks can fail: a misspelt group, a misspelt swept option or a field that does not
    exist; a flag fsdp-lab lacks; a missing make target; an error that is not raised."""

    def check(text: str, doc="```bash\n{}\n```") -> None:
        (c,) = plan_checks(extract_commands(doc.format(text)))
        test_doc_command(c, None)

    for text in (
        "python train.py shardng=full",
        "python train.py -m sharding=full,grad_opp",
        "python train.py model=local model.path=DIR",
        "python train.py sharding=hybrid hardware.nproc_per_node=2",
        "python train.py sharding=full,grad_op",
        "fsdp-lab tune model.path=DIR --memory-gib 4",
    ):
        with pytest.raises(AssertionError, match="does not compose"):
            check(text)
    with pytest.raises(AssertionError, match="unrecognized arguments"):
        check("fsdp-lab plan --memory-gib 4")
    with pytest.raises(AssertionError, match="no Makefile target"):
        check("make tset")
    with pytest.raises(AssertionError, match="has no extra"):
        check('pip install -e ".[tensorbord]"')
    with pytest.raises(AssertionError, match="has no"):
        check("Run `fsdp-lab export --merj`.", doc="{}")
    with pytest.raises(AssertionError, match="does not fail"):
        check("python train.py sharding=full\nfsdp_lab: error: x", doc="```\n$ {}\n```")


def test_a_sweep_needs_multirun():
    """Swept values need ``-m``, or a config that sets Hydra's MULTIRUN mode (hparams_search)."""
    study = ("hparams_search=lr", "optim.lr=tag(log,interval(1e-4,1e-2))")
    validated(study, TrainArgs(study), {})
    with pytest.raises(ValueError, match="a sweep without -m"):
        validated(("sharding=full,grad_op",), TrainArgs(()), {})
    validated(("sharding=full,grad_op",), TrainArgs((), multirun=True), {})
