"""hydra/sweeper=study's search space: each form of Hydra's sweep syntax becomes the Optuna
distribution it names, the shipped searches parse, and a bad one is one line naming it."""

from __future__ import annotations

import optuna
import pytest
from conftest import ROOT
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from fsdp_lab.config import ConfigError
from fsdp_lab.launch import search_space
from fsdp_lab.launch.search_space import SAMPLERS, Sampling, grid_of, parse_space, suggest

FORMS = {
    "interval(0.0, 0.2)": FloatDistribution(0.0, 0.2),
    "interval(1, 5)": FloatDistribution(1.0, 5.0),  # Hydra's interval is of floats
    "tag(log, interval(1e-4, 3e-2))": FloatDistribution(1e-4, 3e-2, log=True),
    "int(interval(1, 8))": IntDistribution(1, 8),
    "tag(log, int(interval(1, 64)))": IntDistribution(1, 64, log=True),
    "choice(0, 10, 20, 50)": CategoricalDistribution([0, 10, 20, 50]),
    "full,grad_op,no_shard": CategoricalDistribution(["full", "grad_op", "no_shard"]),
    "choice([1,2],[3])": CategoricalDistribution(["[1,2]", "[3]"]),  # as the override says
    "shuffle(range(3))": CategoricalDistribution([0, 1, 2]),  # written order: same each run
    "range(1, 5)": IntDistribution(1, 4),  # Hydra's values: 5 excluded
    "range(0, 10, 3)": IntDistribution(0, 9, step=3),
    "range(5, 1, -2)": IntDistribution(3, 5, step=2),
    "float(range(1, 4))": FloatDistribution(1.0, 3.0, step=1.0),
}


@pytest.mark.parametrize("text", FORMS)
def test_each_form_is_the_distribution_it_names(text):
    space = parse_space({"x": text}, [])
    assert space.distributions == {"x": FORMS[text]}
    assert space.fixed == {}


def test_fixed_overrides_pass_through_and_the_last_of_a_key_wins():
    space = parse_space(
        {"optim.lr": "interval(1e-4, 1e-2)", "optim.warmup_steps": "choice(0, 10)"},
        ["hparams_search=lr", "optim.lr=1e-3", "+trainer.extra=3", "optim.warmup_steps=0,5"],
    )
    assert space.distributions == {"optim.warmup_steps": CategoricalDistribution([0, 5])}
    assert space.fixed == {"hparams_search": "lr", "optim.lr": "0.001", "+trainer.extra": "3"}
    assert space.overrides({"optim.warmup_steps": 5}) == [
        "optim.warmup_steps=5",
        "hparams_search=lr",
        "optim.lr=0.001",
        "+trainer.extra=3",
    ]


@pytest.mark.parametrize("name", ["lr", "throughput"])
def test_the_shipped_searches_parse_and_every_trial_draws_inside_them(name):
    params = OmegaConf.load(ROOT / "conf" / "hparams_search" / f"{name}.yaml").hydra.sweeper.params
    space = parse_space(params, [])
    assert set(space.distributions) == set(params) and not space.fixed
    study = optuna.create_study(sampler=Sampling("tpe", {}, 0, space).sampler())
    for _ in range(3):
        drawn = suggest(trial := study.ask(), space)
        assert list(drawn) == list(params)
        for key, value in drawn.items():
            assert space.distributions[key]._contains(
                space.distributions[key].to_internal_repr(value)
            )
        study.tell(trial, 0.0)


BAD = {
    "interval(1)": "missing a required argument: 'end'",
    "tag(lg, interval(1, 2))": r"tag\(lg\) means nothing to the study",
    "tag(log, choice(1, 2))": r"tag\(log\) means nothing",
    "tag(log, interval(0, 1))": "`low > 0` must hold for `log=True`",
    "range(5, 1)": "the range holds no value",
    "interval(2, 1)": "`low <= high` must hold",
}


@pytest.mark.parametrize("text", BAD)
def test_a_bad_space_is_one_line_naming_the_setting(text):
    with pytest.raises(ConfigError, match=BAD[text]) as e:
        parse_space({"optim.lr": text}, [])
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("hydra.sweeper.params: ")
    assert "optim.lr=" in str(e.value) or "interval(1)" in str(e.value)


def test_a_space_with_nothing_to_search_says_how_to_give_one():
    with pytest.raises(ConfigError, match=r"nothing to search.*optim\.lr=interval"):
        parse_space(None, ["optim.lr=1e-3"])


def test_grid_lists_discrete_values_and_refuses_a_continuous_one():
    space = parse_space({"a": "choice(x, y)", "b": "range(0, 6, 2)", "c": "int(interval(1,3))"}, [])
    assert grid_of(space) == {"a": ["x", "y"], "b": [0, 2, 4], "c": [1, 2, 3]}
    assert Sampling("grid", {}, 0, space).num_trials(100) == 2 * 3 * 3
    floats = parse_space({"d": "range(0.5, 2.0, 0.5)"}, [])
    assert grid_of(floats)["d"] == [0.5, 1.0, 1.5]
    continuous = parse_space({"optim.lr": "tag(log, interval(1e-4, 1e-2))"}, [])
    with pytest.raises(ConfigError, match=r"sampler=grid needs values to list, but optim\.lr="):
        grid_of(continuous)


def test_samplers_by_name_and_a_wrong_name_or_option_is_one_line():
    import importlib.util

    space = parse_space({"x": "choice(1, 2)"}, [])
    for name, (cls, needs) in SAMPLERS.items():
        if all(importlib.util.find_spec(m) for m in needs):
            assert type(Sampling(name, {}, 0, space).sampler()) is cls
        else:
            with pytest.raises(ConfigError, match=f"sampler={name} needs .*pip install"):
                Sampling(name, {}, 0, space)
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.sampler=tpee: use one of tpe, ") as e:
        Sampling("tpee", {}, 0, space)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"sampler_options=\{'bogus': 1\}.*TPESampler"):
        Sampling("tpe", {"bogus": 1}, 0, space)
    tpe = Sampling("tpe", {"n_startup_trials": 3}, 0, space).sampler()
    assert tpe._n_startup_trials == 3


def test_each_trial_draws_from_its_own_seed():
    """(seed, trial number): the same trial draws alike in every run; trials, and seeds, apart."""
    space = parse_space({"x": "interval(0, 1)"}, [])

    def draw(seed: int, number: int) -> float:
        study = optuna.create_study()
        trial = study.ask()
        study.sampler = Sampling("random", {}, seed, space).sampler(number)
        return suggest(trial, space)["x"]

    assert draw(0, 4) == draw(0, 4)
    assert len({draw(0, 4), draw(0, 5), draw(1, 4)}) == 3


def test_counts_no_batch_could_run_with_are_one_line():
    search_space.check_counts(1, 0.0)
    search_space.check_counts(4, 1.0)
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.n_jobs=0: give the trials to run"):
        search_space.check_counts(0, 1.0)
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.max_failure_rate=1\.5: give a frac"):
        search_space.check_counts(1, 1.5)
