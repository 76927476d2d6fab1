"""lm-evaluation-harness tasks: which to score (names, include path, limit, few-shot), checked at
launch, and lm-eval's evaluator run over an ``LM`` (``train.harness_lm.ShardedLM``: the sharded
model in training, a plain model in ``fsdp-lab eval``).

lm-eval is the ``eval`` extra (``pip install 'fsdp_lab[eval]'``); nothing imports it before a
run or command asks for harness tasks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from fsdp_lab.config import HARNESS_EXTRA, ConfigError, EvalConfig, first_line

NOISY_LOGGERS = ("lm-eval", "lm_eval", "datasets", "evaluate")


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(
            f"eval.harness_tasks needs lm-evaluation-harness: {HARNESS_EXTRA} "
            "(or pip install lm-eval)"
        ) from None
    for name in NOISY_LOGGERS:  # their progress and advice, per task and per rank
        logging.getLogger(name).setLevel(logging.ERROR)
    import lm_eval

    return lm_eval


def include_dir(setting: str | None) -> str | None:
    """A task folder as an absolute path: relative to the working directory, else to
    fsdp_lab's checkout (``tests/harness_tasks``, the tasks it ships)."""
    if setting is None:
        return None
    checkout = Path(__file__).resolve().parents[2]  # fsdp_lab/train/harness.py
    path = Path(setting).expanduser()
    if not path.exists() and not path.is_absolute() and (checkout / path).is_dir():
        path = checkout / path
    return str(path.resolve())


@dataclass
class HarnessTasks:
    """The tasks to score and how (lm-eval's names: tasks, include path, limit, few-shot)."""

    tasks: list[str]
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    _manager: object = field(default=None, repr=False)

    @classmethod
    def of(cls, e: EvalConfig) -> HarnessTasks:
        return cls(
            list(e.harness_tasks), e.harness_include_path, e.harness_limit, e.harness_num_fewshot
        )

    def task_manager(self):
        """lm-eval's index of tasks (made once): include_path's alone where it holds every task
        asked for (lm-eval's own ~15,000 take seconds to index on every rank), else lm-eval's
        too. ConfigError in one line for a task neither has, naming where it looked."""
        if self._manager is not None:
            return self._manager
        _lm_eval()
        from lm_eval.tasks import TaskManager

        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise ConfigError(
                f"eval.harness_include_path={self.include_path} is not a directory; point it "
                "at a folder of lm-eval task YAMLs"
            )
        manager = None
        if self.include_path is not None:
            manager = TaskManager(
                include_path=self.include_path, include_defaults=False, verbosity="ERROR"
            )
            if not set(self.tasks) <= set(manager.all_tasks):
                manager = None
        if manager is None:
            manager = TaskManager(include_path=self.include_path, verbosity="ERROR")
        unknown = [t for t in self.tasks if t not in set(manager.all_tasks)]
        if unknown:
            where = [self.include_path] if self.include_path else []
            where.append(f"lm-eval {_version()}'s own tasks")
            raise ConfigError(
                f"eval.harness_tasks: unknown task {', '.join(unknown)} (looked in "
                f"{' and '.join(where)}; a task YAML that does not parse is skipped there); "
                "check the name and the YAML, or set eval.harness_include_path to its folder"
            )
        self._manager = manager
        return manager

    def check(self) -> None:
        """At launch: every task is known, and its YAML and data load (one line if not)."""
        self._load(self.task_manager())

    def _load(self, manager) -> dict:
        from lm_eval.tasks import get_task_dict

        try:
            return get_task_dict(self.tasks, manager)
        except Exception as e:  # noqa: BLE001 - a task's YAML or data fails in any way
            raise ConfigError(
                f"eval.harness_tasks={','.join(self.tasks)}: a task does not load "
                f"({first_line(e, limit=200)}); fix its YAML or its data files"
            ) from None

    def evaluate(self, lm) -> dict[str, dict[str, float]]:
        """Each task's metrics for ``lm`` (``metric_name``'s names: ``acc``, ``acc_norm``): the
        numbers only (stderr left out: bootstrap_iters=0 skips computing it)."""
        lm_eval = _lm_eval()
        manager = self.task_manager()
        with _as_local_rank_0():
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=self.tasks,
                task_manager=manager,
                limit=self.limit,
                num_fewshot=self.num_fewshot,
                bootstrap_iters=0,
                log_samples=False,
                verbosity="ERROR",
                # Not the global generators: training's dropout and data draw from them.
                random_seed=None,
                numpy_random_seed=None,
                torch_random_seed=None,
                fewshot_random_seed=0,
            )
        return {
            task: {
                metric_name(metric): float(value)
                for metric, value in metrics.items()
                if "," in metric  # lm-eval's `metric,filter`; not sample_len, alias
                and isinstance(value, int | float)
                and not isinstance(value, bool)
                and "_stderr" not in metric
            }
            for task, metrics in results["results"].items()
        }


def metric_name(key: str) -> str:
    """lm-eval's ``metric,filter`` as fsdp_lab names it: ``acc`` for the unfiltered
    (``acc,none``), ``exact_match/strict-match`` for a filter's (MLflow takes no comma)."""
    metric, _, filtered = key.partition(",")
    return metric if filtered in ("", "none") else f"{metric}/{filtered}"


@contextlib.contextmanager
def _as_local_rank_0():
    """lm-eval's simple_evaluate returns nothing where LOCAL_RANK is not 0 (it takes itself for
    one of accelerate's processes); every rank here evaluates as a world of one. Its progress
    bars are off (TQDM_DISABLE): the log line after says what was scored and how long it took."""
    wanted = {"LOCAL_RANK": "0", "TQDM_DISABLE": "1"}  # and no progress bars, per rank
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _version() -> str:

    return version("lm_eval")
