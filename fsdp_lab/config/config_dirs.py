"""Where Hydra finds configs: the groups shipped in the package, and a user's own config dirs.

The package carries its configs (``fsdp_lab/conf``, Hydra's ``pkg://fsdp_lab.conf``), so every
command composes from any directory, installed from a wheel or from a checkout (where ``conf/``
at the top is a link to the same folder). A user's config dir adds options to any group and
experiments of its own beside the shipped ones, Hydra's way: ``--config-dir DIR`` (``-cd``) or
``hydra.searchpath=[DIR]``. It is checked before Hydra sees it (Hydra only warns of a missing
one), and a compose error names the file it came from. Imports no torch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path

from fsdp_lab.config.errors import ConfigError

CONF_MODULE = "fsdp_lab.conf"
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # fsdp_lab/config/config_dirs.py
DIR_FLAGS = ("--config-dir", "-cd")
SEARCHPATH = "hydra.searchpath="


def shipped(path: str) -> Path | None:
    """A file shipped with the configs, named as the docs name it (``conf/chat_templates/
    chatml.jinja``, or ``chat_templates/chatml.jinja``); None if there is no such file."""
    rel = Path(path)
    if rel.is_absolute():
        return None
    parts = rel.parts[1:] if rel.parts[:1] == ("conf",) else rel.parts
    found = CONF_DIR.joinpath(*parts) if parts else None
    return found if found is not None and found.is_file() else None


@functools.cache
def _shipped_options() -> tuple[Path, ...]:
    """Every YAML the package ships, relative to its conf dir (read once a process)."""
    return tuple(sorted(p.relative_to(CONF_DIR) for p in CONF_DIR.rglob("*.yaml")))


def check_dir(path: str, setting: str) -> Path:
    """A user's config dir, absolute; one line if it is not a directory, or if it holds an
    option named as a shipped one (which Hydra would pass over without a word: it searches
    the package's groups first)."""
    where = Path(path.removeprefix("file://")).expanduser()
    if not where.is_dir():
        raise ConfigError(
            f"{setting} {path}: no such directory; point it at a folder of config groups "
            "(e.g. my_experiments/conf with model/my_model.yaml in it)"
        )
    where = where.resolve()
    for rel in _shipped_options():
        option = where / rel  # a stat per shipped file: the user's dir may be a whole repo
        if option.is_file():
            mine = rel.with_name(f"my_{rel.name}").as_posix()
            if len(rel.parts) == 1:  # the primary config.yaml: not an option of any group
                raise ConfigError(
                    f"{option}: fsdp_lab's own conf/{rel.name} is the one composed, so yours "
                    "is never read; put its settings in an experiment (experiment/my_run.yaml, "
                    "starting `# @package _global_`) and select it with experiment=my_run"
                )
            raise ConfigError(
                f"{option}: fsdp_lab ships an option of this name (conf/{rel.as_posix()}), "
                f"which Hydra reads instead of yours; rename yours (e.g. {mine}) and select "
                "it by that name"
            )
    return where


def _is_searchpath(item: str) -> bool:
    """A ``hydra.searchpath=`` override, also as ``+``/``++`` adds it."""
    return item.lstrip("+").startswith(SEARCHPATH)


def _searchpath_entries(overrides: Iterable[str]) -> list[str]:
    """Every entry of the ``hydra.searchpath=[...]`` overrides, in order, schemes kept."""
    entries: list[str] = []
    for item in overrides:
        if _is_searchpath(item):
            listed = item.lstrip("+")[len(SEARCHPATH) :].strip().strip("[]")
            entries += [d.strip().strip("'\"") for d in listed.split(",") if d.strip()]
    return entries


def searchpath_dirs(overrides: Iterable[str]) -> list[str]:
    """The local directories ``hydra.searchpath`` overrides name (file:// or plain paths; a
    ``pkg://`` entry is a package, which Hydra finds itself)."""
    return [d for d in _searchpath_entries(overrides) if "://" not in d or d.startswith("file:")]


def split_dir_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without ``--config-dir DIR`` / ``-cd DIR`` / ``--config-dir=DIR``, and those
    dirs, in order."""
    rest: list[str] = []
    dirs: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in DIR_FLAGS and eq:
            dirs.append(value)
        elif arg in DIR_FLAGS:
            value = next(it, None)
            if value is None:
                raise ConfigError(f"{arg} needs a directory: {arg} my_experiments/conf")
            dirs.append(value)
        else:
            rest.append(arg)
    return rest, dirs


def with_config_dirs(overrides: list[str], dirs: list[str]) -> list[str]:
    """``overrides`` with ``dirs`` (checked, absolute) and every ``hydra.searchpath`` entry
    (local ones checked and made absolute, ``pkg://`` ones kept) as one ``hydra.searchpath``
    override (Hydra searches them after the package's groups)."""
    listed = [f"file://{check_dir(d, '--config-dir')}" for d in dirs]
    for entry in _searchpath_entries(overrides):
        local = "://" not in entry or entry.startswith("file:")
        listed.append(f"file://{check_dir(entry, 'hydra.searchpath')}" if local else entry)
    rest = [o for o in overrides if not _is_searchpath(o)]
    return [f"{SEARCHPATH}[{','.join(listed)}]", *rest] if listed else rest


_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
_OPTIONS = re.compile(r"Available options in '([^']+)':\s*\n((?:[ \t]+\S+\n?)+)")
_IN_FILE = re.compile(r"In '([^']+)': \w+ raised while composing config:\s*\n(.+)")


def compose_error(message: str, dirs: Iterable[str]) -> str:
    """Hydra's compose error in one line, naming the file the bad option came from (the
    package's groups first, then a user's config dirs, in the order Hydra searches them)."""
    found = _IN_FILE.search(message)
    options = _OPTIONS.search(message)
    if options is not None:  # an unknown group option: the ones there are, on the same line
        listed = ", ".join(options.group(2).split())
        first = message.strip().splitlines()[0]
        return f"{first}; Available options in '{options.group(1)}': {listed}"
    if found is None:
        first = message.strip().splitlines()[0]
        if "override_grammar" in message:  # a command-line override that does not parse
            return f"an override does not parse: {first} (Hydra's override grammar: {_GRAMMAR})"
        return first
    option, reason = found.group(1), found.group(2).strip()
    key = re.search(r"full_key: (\S+)", message)
    for root in [CONF_DIR, *(Path(d.removeprefix("file://")) for d in dirs)]:
        path = root / f"{option}.yaml"
        if path.is_file():
            option = str(path)
            break
    fix = f" ({key.group(1)})" if key else ""
    return f"{option}: {reason}{fix}; fix the key, or see the group's schema in fsdp_lab/config"
