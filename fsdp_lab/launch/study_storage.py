"""Where a study lives (``hydra.sweeper.storage``) and how it is opened: SQLite in the sweep
dir, a journal file (for sweep processes on several nodes) or a database URL; created, or loaded
to continue. A file that cannot be read as a study is refused in one line and left as it is:
one that is not a study, one another sweep is writing, a read-only one, one written by an older
Optuna (with the command that upgrades it, keeping its trials), and one made for another
objective or direction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import optuna

from fsdp_lab.config import ConfigError, Objective

if TYPE_CHECKING:
    from fsdp_lab.launch.study_settings import StudySweeperConf


def storage_of(setting: str, sweep_dir: Path) -> tuple[str | optuna.storages.BaseStorage, str]:
    """``hydra.sweeper.storage`` as (Optuna's storage, where it is, for messages): ``sqlite``:
    optuna.db in the sweep dir; ``journal``: optuna.journal there; ``journal://PATH``: a journal
    file at PATH; ``sqlite:///PATH`` or another database URL as it is. Relative paths are taken
    from the dir train.py was started in, made absolute."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if setting == "sqlite":
        setting = f"sqlite:///{sweep_dir / 'optuna.db'}"
    elif setting == "journal":
        setting = f"journal://{sweep_dir / 'optuna.journal'}"
    if setting.startswith("journal://") and setting != "journal://":
        path = Path(setting[len("journal://") :]).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_journal(path, where := f"journal://{path}")
        return JournalStorage(JournalFileBackend(str(path))), where
    if setting.startswith("sqlite:///") and not setting.startswith("sqlite:////"):
        setting = "sqlite:///" + str(Path(setting[len("sqlite:///") :]).resolve())
    if "://" not in setting or setting.startswith("journal://"):
        raise ConfigError(
            f"hydra.sweeper.storage={setting}: use sqlite (optuna.db in the sweep dir), journal "
            "(optuna.journal there, for processes on several nodes), journal://PATH, "
            "sqlite:///PATH or another database URL"
        )
    return setting, setting


def _check_journal(path: Path, where: str) -> None:
    """Optuna appends to any file it is given as a journal: one whose first line is not a
    journal entry is refused before, and left as it is."""
    if not path.exists():
        return
    try:
        with open(path, "rb") as f:
            entry = json.loads(f.readline(1 << 16) or b'{"op_code": 0}')
    except (OSError, ValueError) as e:
        raise ConfigError(_unreadable(where, e)) from None
    if not isinstance(entry, dict) or "op_code" not in entry:
        raise ConfigError(_unreadable(where, ValueError("not an Optuna journal")))


def open_study(settings: StudySweeperConf, sweep_dir: Path, objective: Objective) -> optuna.Study:
    """The study in its storage: created, or loaded to continue. Refused, and left as it is:
    one that cannot be read (not a database or a journal, a newer Optuna's), one in use or
    read-only, and one made for another objective or direction (its values would not compare
    with the new). Optuna loads a study of another direction silently: checked here."""
    import sqlalchemy.exc

    name, direction = settings.study_name, settings.direction
    storage, where = storage_of(settings.storage, sweep_dir)
    try:
        study = optuna.create_study(
            study_name=name, storage=storage, direction=direction, load_if_exists=True
        )
        made_for = study.user_attrs.get("objective")
        if made_for is None:
            study.set_user_attr("objective", objective.value)
    except (
        sqlalchemy.exc.SQLAlchemyError,
        optuna.exceptions.StorageInternalError,  # a failed write: its cause is SQLAlchemy's
        RuntimeError,
        ValueError,  # a journal file that is not one (JSONDecodeError)
    ) as e:
        raise ConfigError(_unreadable(where, e)) from None
    why = None
    if [d.name.lower() for d in study.directions] != [direction]:
        why = f"another direction ({study.directions[0].name.lower()}, not {direction})"
    elif made_for is not None and made_for != objective.value:
        why = f"objective={made_for}, not {objective.value}"
    if why:
        raise ConfigError(
            f"study {name} in {where} was made for {why}: continue it with its own settings, "
            "or give this search another hydra.sweep.dir (or hydra.sweeper.study_name)"
        )
    return study


def _unreadable(where: str, e: Exception) -> str:
    cause = e.__cause__ if isinstance(e, optuna.exceptions.StorageInternalError) else e
    reason = (str(getattr(cause, "orig", None) or cause).splitlines() or [repr(cause)])[0]
    if "locked" in reason:
        return (
            f"hydra.sweeper.storage={where}: {reason} (another sweep is writing this study): "
            "wait for it to end, or set another hydra.sweep.dir"
        )
    if "optuna storage upgrade" in reason:  # a study an older Optuna wrote (the 2.10 we pinned)
        made_by = reason.partition("(set up by ")[2].partition(")")[0] or "an older Optuna"
        return (
            f"hydra.sweeper.storage={where} was written by {made_by}: upgrade it in place, "
            f"keeping its trials, with `optuna storage upgrade --storage {where}` (copy the "
            "file first if that Optuna must read it again), then rerun"
        )
    if "readonly" in reason:
        return (
            f"hydra.sweeper.storage={where}: {reason}: make it writable, or set another "
            "hydra.sweep.dir"
        )
    return (
        f"hydra.sweeper.storage={where} cannot be opened as an Optuna study ({reason}); "
        "move that file away to start a new study, or set another hydra.sweep.dir"
    )
