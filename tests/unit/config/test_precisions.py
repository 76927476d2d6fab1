"""The precision table: a row per dtype and per float8 recipe, what reads them follows the
rows, and no other module dispatches on a dtype's or a recipe's name."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import assert_only_named_in

from fsdp_lab.config import ConfigError, Dtype, Float8Recipe
from fsdp_lab.config import precisions as prec
from fsdp_lab.config.precisions import check_precision
from fsdp_lab.config.sharding import PrecisionConfig


def test_every_dtype_and_recipe_has_one_row():
    assert set(prec.DTYPES) == set(Dtype)
    assert set(prec.FLOAT8_RECIPES) == set(Float8Recipe)
    assert prec.FLOAT8_RECIPES[prec.TUNED_RECIPE].all_gather  # tune's gathers in float8


NAMED = re.compile(r"\b(Dtype\.(fp32|bf16|fp16)|Float8Recipe\.(tensorwise|rowwise))\b")


def test_no_other_module_dispatches_on_a_dtype_or_recipe_name():
    # The schema names the defaults; the table says what each means.
    assert_only_named_in(
        {"config/precisions.py", "config/sharding.py"},
        NAMED,
        ["if p.param_dtype is Dtype.bf16:"],
        "precision dispatch outside config.precisions",
    )


def test_what_reads_the_rows_follows_them(monkeypatch):
    """A throwaway change to a row moves what reads it: the rules, the plan's bytes."""
    from fsdp_lab.planning import plan

    fp32 = PrecisionConfig()
    check_precision(fp32)
    before = plan.build_plan([], "cpu").chosen_plan.time.comm_s
    rows = dict(prec.DTYPES)
    rows[Dtype.fp32] = dataclasses.replace(rows[Dtype.fp32], bytes=8)
    monkeypatch.setattr(prec, "DTYPES", rows)
    # twice the bytes a parameter: the time model's collectives move twice as much
    assert plan.build_plan([], "cpu").chosen_plan.time.comm_s > 1.5 * before
    rows[Dtype.fp32] = dataclasses.replace(rows[Dtype.fp32], needs_scaler=True)
    with pytest.raises(ConfigError, match=r"param_dtype=fp32 needs precision\.grad_scaler"):
        check_precision(fp32)
    recipes = dict(prec.FLOAT8_RECIPES)
    rowwise = PrecisionConfig(
        param_dtype=Dtype.bf16, float8_recipe=Float8Recipe.rowwise, float8_all_gather=True
    )
    with pytest.raises(ConfigError, match="float8_all_gather=true needs"):
        check_precision(rowwise)
    recipes[Float8Recipe.rowwise] = prec.Float8Row(all_gather=True)
    monkeypatch.setattr(prec, "FLOAT8_RECIPES", recipes)
    check_precision(rowwise)
    assert prec.float8_all_gather(dataclasses.replace(rowwise, float8_all_gather=None))
