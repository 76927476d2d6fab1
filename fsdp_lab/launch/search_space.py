"""What a study searches, towards what, and how it samples (``hydra/sweeper=study``, see
``launch.study``): all that is checked before a study is opened.

``hydra.sweeper.params`` and the command line's overrides are read by Hydra's own override
parser, in the syntax hydra-optuna-sweeper read, so conf/hparams_search/ is unchanged:

| value | Optuna distribution |
| --- | --- |
| ``interval(a,b)`` | ``FloatDistribution(a, b)`` (Hydra makes both ends floats) |
| ``int(interval(a,b))`` | ``IntDistribution(a, b)`` |
| ``tag(log, interval(a,b))`` | the same with ``log=True`` (log is the only tag) |
| ``choice(a,b)``, ``a,b``, ``shuffle(range(...))`` | ``CategoricalDistribution`` |
| ``range(a,b[,step])`` | ``Int``/``FloatDistribution(first, last, step)`` of Hydra's values |
| anything else | fixed: the same override for every trial |

``range`` takes Hydra's values, ``b`` excluded as in a grid sweep; hydra-optuna-sweeper also
let the sampler propose ``b`` (and its grid did not). Of one key given twice (params, then the
command line) the last wins. The objective (``objective=``) and ``hydra.sweeper.direction``
must agree; ``hydra.sweeper.sampler`` names a row of SAMPLERS.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    IntervalSweep,
    Override,
    RangeSweep,
    Transformer,
)
from hydra.errors import HydraException
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from fsdp_lab.config import ConfigError, Objective
from fsdp_lab.launch import sweep

DIRECTION = {
    Objective.val_loss: "minimize",
    Objective.best_val_loss: "minimize",
    Objective.tokens_per_s: "maximize",
    Objective.harness: "maximize",  # accuracy, exact match
}
FORMS = "interval(a,b), int(interval(a,b)), tag(log,interval(a,b)), choice(a,b), a,b or range(a,b)"
# hydra.sweeper.sampler: the Optuna sampler, and the packages it needs beyond Optuna.
SAMPLERS = {
    "tpe": (optuna.samplers.TPESampler, ()),
    "random": (optuna.samplers.RandomSampler, ()),
    "grid": (optuna.samplers.GridSampler, ()),
    "gp": (optuna.samplers.GPSampler, ("scipy", "torch")),
    "cmaes": (optuna.samplers.CmaEsSampler, ("cmaes",)),
}


@dataclass(frozen=True)
class SearchSpace:
    """The searched parameters (override key -> distribution) and the fixed overrides (key ->
    value as written), each trial's overrides being both; ``written`` keeps each searched
    key's text for messages."""

    distributions: dict[str, BaseDistribution]
    fixed: dict[str, str]
    written: dict[str, str]

    def overrides(self, params: Mapping[str, object]) -> list[str]:
        """One trial's command-line overrides: its sampled values, then the fixed ones."""
        return [f"{k}={v}" for k, v in params.items()] + [f"{k}={v}" for k, v in self.fixed.items()]


def parse_space(params: Mapping[str, object] | None, arguments: list[str]) -> SearchSpace:
    """``hydra.sweeper.params`` then the command line's overrides: what is searched, what is
    fixed. A value Hydra cannot parse, or one Optuna cannot search, is one line naming it."""
    texts = [f"{k}={v}" for k, v in (params or {}).items()] + list(arguments)
    parser = OverridesParser.create()
    distributions, fixed, written = {}, {}, {}
    for text in texts:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as e:
            raise ConfigError(
                f"hydra.sweeper.params: {_one_line(e)}; write it as {FORMS}"
            ) from None
        key = override.get_key_element()
        distributions.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            distributions[key] = _distribution(override, text)
            written[key] = text
        else:
            fixed[key] = override.get_value_element_as_str()
    if not distributions:
        raise ConfigError(
            "the study has nothing to search: give hydra.sweeper.params (see "
            "conf/hparams_search/) or a range on the command line, e.g. "
            "'optim.lr=interval(1e-4,1e-2)'"
        )
    return SearchSpace(distributions, fixed, written)


def _one_line(e: Exception) -> str:
    """Hydra's parse error without its doc link, on one line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return ": ".join(ln for ln in lines if not ln.startswith("See https://")) or repr(e)


def _distribution(override: Override, text: str) -> BaseDistribution:
    """A sweep override as the distribution its trials are drawn from (the table above)."""
    sweep = override.value()
    tags = getattr(sweep, "tags", set())  # a glob(...) has none (and is refused below)
    bad_tags = tags - {"log"} if isinstance(sweep, IntervalSweep) else tags
    if bad_tags:
        raise ConfigError(
            f"hydra.sweeper.params: {text}: tag({', '.join(sorted(bad_tags))}) means nothing "
            "to the study; the one tag is log, on an interval: tag(log,interval(a,b))"
        )
    try:
        match sweep:
            case ChoiceSweep() | RangeSweep(shuffle=True):
                return CategoricalDistribution(_values(sweep))
            case RangeSweep():
                return _range_distribution(_values(sweep), abs(sweep.step))
            case IntervalSweep(start=int(), end=int()):
                return IntDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
            case IntervalSweep():
                return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
            case _:
                raise ValueError(f"a {type(sweep).__name__} cannot be searched")
    except ValueError as e:
        raise ConfigError(f"hydra.sweeper.params: {text}: {e}; write it as {FORMS}") from None


def _values(sweep: ChoiceSweep | RangeSweep) -> list:
    """A discrete sweep's values in their written order (not shuffle's, new each run: a
    continued study's distributions must equal its first run's); lists and dicts as their
    override text, what the trial's override will say."""
    items = sweep.list if isinstance(sweep, ChoiceSweep) else sweep.range()
    return [Transformer.encode(x) for x in items]


def _range_distribution(values: list, step: float) -> BaseDistribution:
    if not values:
        raise ValueError("the range holds no value")
    low, high = min(values), max(values)
    if all(isinstance(v, int) for v in values):
        return IntDistribution(low, high, step=int(step))
    return FloatDistribution(low, high, step=step)


def grid_of(space: SearchSpace) -> dict[str, list]:
    """sampler=grid's points: every value of each discrete parameter; a continuous one (a
    float interval, a log interval) has no grid and is refused in one line."""
    grid = {}
    for key, d in space.distributions.items():
        match d:
            case CategoricalDistribution():
                grid[key] = list(d.choices)
            case IntDistribution(log=False):
                grid[key] = list(range(d.low, d.high + 1, d.step))
            case FloatDistribution(log=False, step=float() | int()):
                num = round((d.high - d.low) / d.step)
                grid[key] = [d.low + i * d.step for i in range(num + 1)]
            case _:
                raise ConfigError(
                    f"hydra.sweeper.sampler=grid needs values to list, but {space.written[key]} "
                    "is continuous: give it as choice(...) or range(...), or use another sampler"
                )
    return grid


@dataclass
class Sampling:
    """``hydra.sweeper.sampler`` with ``sampler_options`` (its class's keyword arguments), from
    one seed: the study's sampler, and each trial's, seeded from (seed, trial number) so that
    processes asking at once, and a continued study, draw apart. sampler=grid keeps the one
    seed: each trial's grid point indexes its shuffled order of points."""

    name: str
    options: Mapping[str, object]
    seed: int
    space: SearchSpace
    grid: dict[str, list] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ConfigError(
                f"hydra.sweeper.sampler={self.name}: use one of {', '.join(SAMPLERS)}"
            )
        missing = [m for m in SAMPLERS[self.name][1] if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"hydra.sweeper.sampler={self.name} needs {', '.join(missing)}: pip install "
                f"{' '.join(missing)}, or use sampler=tpe"
            )
        if self.name == "grid":
            self.grid = grid_of(self.space)
        self.sampler()  # a bad option: refused before the study is opened

    def num_trials(self, n_trials: int) -> int:
        """n_trials, of a grid at most its number of points: each runs once."""
        points = math.prod(map(len, self.grid.values())) if self.grid is not None else n_trials
        return min(n_trials, points)

    def draw(self, study: optuna.Study, trial: optuna.Trial) -> dict[str, object]:
        """The trial's values, drawn by a sampler seeded for its number, before the next trial
        is asked: each of a batch's trials draws from its own seed."""
        study.sampler = self.sampler(trial.number)
        return suggest(trial, self.space)

    def sampler(self, trial_number: int | None = None) -> optuna.samplers.BaseSampler:
        cls = SAMPLERS[self.name][0]
        seed = self.seed
        if trial_number is not None and self.grid is None:
            seed = int(np.random.SeedSequence([seed, trial_number]).generate_state(1)[0])
        try:
            if self.grid is not None:
                return cls(self.grid, seed=seed, **dict(self.options))
            return cls(seed=seed, **dict(self.options))
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"hydra.sweeper.sampler_options={dict(self.options)}: {e}; give keyword "
                f"arguments of optuna.samplers.{cls.__name__}"
            ) from None


def suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, object]:
    """Draw the trial's value of every searched parameter (Optuna's public suggest_* calls)."""
    for key, d in space.distributions.items():
        match d:
            case CategoricalDistribution():
                trial.suggest_categorical(key, d.choices)
            case IntDistribution():
                trial.suggest_int(key, d.low, d.high, step=d.step, log=d.log)
            case FloatDistribution():
                trial.suggest_float(key, d.low, d.high, step=d.step, log=d.log)
            case _:
                raise RuntimeError(f"{key}: no suggest call for {d!r}")
    return {key: trial.params[key] for key in space.distributions}


def checked_objective(config, direction: str) -> Objective:
    """``objective=``, refused where the search could not read it or would go the wrong way."""
    objective = sweep.objective_of(config)
    if objective is Objective.harness:
        tasks, metric = list(config.eval.harness_tasks), config.eval.get("objective_metric")
        if not tasks:
            raise ConfigError(
                "objective=harness needs eval.harness_tasks (the scores it reads); set "
                "eval.harness_tasks=[task] and eval.objective_metric=task/metric"
            )
        if metric is not None and metric.split("/")[0] not in tasks:
            raise ConfigError(
                f"eval.objective_metric={metric} names no task of eval.harness_tasks={tasks}; "
                f"give it as task/metric, e.g. {tasks[0]}/acc"
            )
    if objective in (Objective.val_loss, Objective.best_val_loss) and not config.trainer.eval_every:
        raise ConfigError(
            f"objective={objective.name} needs validation but trainer.eval_every=0: set "
            "trainer.eval_every (validation also runs after the last step) or "
            "objective=tokens_per_s"
        )
    if direction != DIRECTION[objective]:
        raise ConfigError(
            f"hydra.sweeper.direction={direction} but objective={objective.name} is to "
            f"{DIRECTION[objective]}: set hydra.sweeper.direction={DIRECTION[objective]}"
        )
    return objective


def check_counts(n_jobs: int, max_failure_rate: float) -> None:
    """``hydra.sweeper.n_jobs`` and ``max_failure_rate``, refused where no batch could run or
    the rate means nothing."""
    if n_jobs < 1:
        raise ConfigError(f"hydra.sweeper.n_jobs={n_jobs}: give the trials to run at once, >= 1")
    if not 0.0 <= max_failure_rate <= 1.0:
        raise ConfigError(
            f"hydra.sweeper.max_failure_rate={max_failure_rate}: give a fraction of a batch's "
            "trials, from 0.0 (stop at the first failure) to 1.0 (never stop)"
        )
