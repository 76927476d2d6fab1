"""The commands the README and docs/*.md show, as written: found in their fenced command
blocks (bash, sh, shell, console; an untagged block of ``$ `` lines is a console) and in inline
code spans that start with a command, and split into what each runs. Read by
tests/integration/test_docs.py, which checks them; nothing here runs anything."""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass

FENCE_LANGS = {"bash", "sh", "shell", "console"}
COMMAND_WORDS = ("python", "python3", "fsdp-lab", "torchrun", "sbatch", "srun", "make", "pip")
# Recognised and not run: set-up and shell plumbing (a new one is added here).
SHELL_WORDS = {
    *("cd", "export", "source", ".", "tail", "head", "ls", "cat", "echo", "mkdir", "git"),
    *("tensorboard", "mlflow", "wandb", "nvidia-smi", "squeue", "scancel", "sinfo", "scontrol"),
}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# An inline span that is a command: a command word, after any VAR=value of the environment.
_WORDS = "|".join(map(re.escape, COMMAND_WORDS))
INLINE_COMMAND = re.compile(rf"^([A-Z_][A-Z0-9_]*=\S*\s+)*({_WORDS})(\s|$)")
SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")
SEPARATORS = {"&&", "||", ";", "|"}
ERROR_PREFIXES = ("fsdp_lab: error: ", "fsdp-lab: error: ")


# --- extraction -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    doc: str  # the file, relative to the checkout
    line: int  # the line the command starts on
    text: str  # as written, continuation lines joined
    argv: tuple[str, ...]  # after leading VAR=value assignments, up to the first && ; | ||
    env: tuple[tuple[str, str], ...] = ()  # those assignments
    inline: bool = False  # a code span in prose: a mention, with placeholders
    error: str | None = None  # console: the `fsdp_lab: error:` line shown after it
    output: tuple[str, ...] = ()  # console: the lines shown after it

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str | None:
        a = self.argv
        word = (os.path.basename(a[0]) or a[0]) if a else ""
        if "train.py" in a and word in ("python", "python3", "torchrun", "srun"):
            return "train"
        if word == "fsdp-lab" and a[1:2] == ("train",):  # the same command, installed
            return "train"
        if word in ("python", "python3") and a[1:3] == ("-m", "fsdp_lab"):
            return "train"
        if word == "sbatch" and any(t.endswith(".sbatch") for t in a):
            return "sbatch"
        if word in ("python", "python3") and a[1:2] == ("-m",):
            return "module"
        if word in ("python", "python3") and len(a) > 1 and a[1].endswith(".py"):
            return "script"
        if word in ("fsdp-lab", "make", "pip"):
            return word
        if word in SHELL_WORDS or (self.inline and word in COMMAND_WORDS):
            return "shell"  # inline: a tool named in prose (`torchrun`, `sbatch --signal=...`)
        return None

    @property
    def id(self) -> str:
        words = [f"{k}={v}" for k, v in self.env] + list(self.argv)
        return f"{self.doc}:{self.line}:" + shlex.join(words)[:70]


def _logical_lines(block: list[tuple[int, str]], console: bool) -> list[tuple[int, str, list]]:
    """Join ``\\`` continuations; in a console block only ``$ `` lines are commands, and the
    lines after one are its output."""
    out: list[tuple[int, str, list]] = []
    pending: tuple[int, str] | None = None
    for number, raw in block:
        line = raw.rstrip()
        if pending is None:
            stripped = line.lstrip()
            if console:
                if not stripped.startswith("$ "):
                    if out:
                        out[-1][2].append(stripped)
                    continue
                stripped = stripped[2:]
            pending = (number, "")
            line = stripped
        start, text = pending
        if line.endswith("\\"):
            pending = (start, text + line[:-1] + " ")
            continue
        out.append((start, text + line, []))
        pending = None
    if pending is not None:
        out.append((*pending, []))
    return out


def blocks(markdown: str):
    """(language, [(line number, line)]) of every fenced block, and the prose lines."""
    block, lang, prose = None, "", []
    for number, line in enumerate(markdown.splitlines(), start=1):
        fence = re.match(r"^\s*(```|~~~)\s*([\w+-]*)", line)
        if fence:
            if block is None:
                lang, block = fence.group(2).lower(), []
            else:
                yield lang, block
                block = None
        elif block is not None:
            block.append((number, line))
        else:
            prose.append((number, line))
    assert block is None, "a fenced block is never closed"
    yield "prose", prose


def is_console(lang: str, block) -> bool:
    return lang == "console" or (lang in ("", "text") and any(s.startswith("$ ") for _, s in block))


def extract_commands(markdown: str, doc: str = "README.md") -> list[Command]:
    """The commands of every command block and inline code span, in order."""
    commands: list[Command] = []
    for lang, block in blocks(markdown):
        if lang == "prose":
            for number, line in block:
                for span in re.findall(r"`([^`]+)`", line):
                    if INLINE_COMMAND.match(span):
                        commands.extend(_parse(doc, number, span, inline=True))
        elif lang in FENCE_LANGS or is_console(lang, block):
            for start, text, output in _logical_lines(block, console=is_console(lang, block)):
                error = next((o for o in output if o.startswith(ERROR_PREFIXES)), None)
                commands.extend(_parse(doc, start, text, error=error, output=tuple(output)))
    return commands


def _parse(doc: str, line: int, text: str, **kw) -> list[Command]:
    if not text.strip() or text.lstrip().startswith("#"):
        return []
    inner = [c for s in SUBSTITUTION.findall(text) for c in _parse(doc, line, s, **kw)]
    try:
        tokens = shlex.split(SUBSTITUTION.sub("$SUBST", text), comments=True)
    except ValueError as e:  # unbalanced quotes: a broken command, shown as one that fails
        return [Command(doc, line, text.strip(), ("python", "train.py", f"<unparsable: {e}>"))]
    commands = inner
    for is_sep, group in itertools.groupby(tokens, key=lambda t: t in SEPARATORS):
        group = list(group)
        env = []
        while group and not is_sep and ENV_ASSIGNMENT.match(group[0]):
            key, _, value = group.pop(0).partition("=")
            env.append((key, value))
        if group and not is_sep:
            commands.append(Command(doc, line, text.strip(), tuple(group), tuple(env), **kw))
    return commands


# --- train.py's arguments ---------------------------------------------------------------------


def override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def override_value(override: str) -> str:
    return override.partition("=")[2]


def merge(overrides: list[str], forced: tuple[str, ...]) -> list[str]:
    """``overrides`` with ``forced`` appended, dropping any of the former for the same key."""
    keys = {override_key(o) for o in forced}
    return [o for o in overrides if override_key(o) not in keys] + list(forced)


@dataclass(frozen=True)
class TrainArgs:
    overrides: tuple[str, ...]
    multirun: bool = False
    show_cfg: bool = False  # the command itself is ``--cfg ...``
    nproc: int | None = None  # ranks per node, when torchrun or SLURM says
    nodes: int | None = None
    script: str | None = None  # sbatch's


def _launcher_options(tokens) -> dict[str, str]:
    """``--key=value`` options of torchrun, srun or sbatch, as {key: value}."""
    return dict(t[2:].replace("-", "_").split("=", 1) for t in tokens if re.match(r"--\S+=", t))


def train_args(c: Command) -> TrainArgs:
    """The overrides of ``... train.py ARGS`` or ``sbatch ... X.sbatch ARGS`` (flags set aside,
    ellipses dropped), and the ranks its launcher asks for."""
    a = list(c.argv)
    # train.py, an sbatch script, or the installed command's last word (fsdp-lab train,
    # python -m fsdp_lab)
    ends = ("train.py", "train", "fsdp_lab")
    i = next(i for i, t in enumerate(a) if t in ends or t.endswith(".sbatch"))
    opts = _launcher_options(a[:i])
    nodes = int(opts["nodes"]) if opts.get("nodes", "").isdigit() else None
    nodes = nodes or (int(opts["nnodes"]) if opts.get("nnodes", "").isdigit() else None)
    nproc = opts.get("nproc_per_node") or opts.get("ntasks_per_node")
    if nproc is None and "ntasks" in opts:
        nproc = int(opts["ntasks"]) // (nodes or 1)
    args, overrides, flags = a[i + 1 :], [], set()
    while args:
        t = args.pop(0)
        if t in ("--config-dir", "-cd") and args:  # a user's config dir: kept as Hydra takes it
            overrides.append(f"hydra.searchpath=[{args.pop(0)}]")
        elif t in ("-m", "--multirun", "--cfg", "-c"):
            flags.add("multirun" if t in ("-m", "--multirun") else "cfg")
            if t in ("--cfg", "-c") and args:
                args.pop(0)
        elif t not in ("...", "…"):
            overrides.append(t)
    return TrainArgs(
        tuple(overrides),
        multirun="multirun" in flags,
        show_cfg="cfg" in flags,
        nproc=int(nproc) if nproc is not None else None,
        nodes=nodes,
        script=a[i] if a[i].endswith(".sbatch") else None,
    )
