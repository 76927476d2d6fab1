"""The loss table: a row per loss, its code registered once, and no other place that
dispatches on a loss's name."""

from __future__ import annotations

import re

import pytest
from conftest import assert_only_named_in

from fsdp_lab.config import LossKind
from fsdp_lab.config.losses import LOSSES, loss_needs_triton, loss_of, loss_runs_anywhere

L = LossKind


def test_every_loss_but_auto_has_one_row():
    assert set(LOSSES) == set(LossKind) - {L.auto}
    with pytest.raises(RuntimeError, match="no row"):
        loss_of(L.auto)


def test_every_row_has_its_code_once():
    from fsdp_lab.train import loss as loss_lib

    assert set(loss_lib.FUSED_LOSSES) == {k for k, row in LOSSES.items() if row.fused}
    assert set(loss_lib.LOGIT_LOSSES) == {k for k, row in LOSSES.items() if not row.fused}


@pytest.mark.parametrize(
    "kind,fused,package,triton,own",
    [
        (L.hf, False, None, False, True),
        (L.z_loss, False, None, False, False),
        (L.chunked, True, None, False, False),
        (L.liger, True, "liger-kernel", True, False),
        (L.cce, True, "cut-cross-entropy", True, False),
    ],
)
def test_each_row_says_what_the_loss_needs(kind, fused, package, triton, own):
    row = loss_of(kind)
    assert (row.fused, row.package and row.package.pip, row.triton, row.own) == (
        fused,
        package,
        triton,
        own,
    )
    assert (loss_needs_triton(kind), loss_runs_anywhere(kind)) == (triton, own)
    assert loss_runs_anywhere(L.auto) and not loss_needs_triton(L.auto)


NAMED = re.compile(r"\bLossKind\.(hf|z_loss|chunked|liger|cce)\b")


def test_no_other_module_dispatches_on_a_loss_name():
    # The schema names the kinds, the table says what each needs, train.loss_code holds their code
    # and auto's choice among them.
    allowed = {"config/losses.py", "config/training.py", "train/loss.py", "train/loss_code.py"}
    what = "loss dispatch outside config.losses"
    assert_only_named_in(allowed, NAMED, ["if kind is LossKind.liger:"], what)


def test_the_plan_models_two_losses_and_every_other_row_says_which_it_is_counted_as():
    modelled = {LossKind.hf, LossKind.chunked}
    assert {k for k, row in LOSSES.items() if row.memory_as is None} == modelled
    assert {row.memory_as for row in LOSSES.values()} - {None} <= modelled
