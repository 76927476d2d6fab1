"""Real multi-process gloo runs of every strategy against one unsharded process.

Each run is `python train.py` as a user starts it; its metrics.jsonl is compared step by step
with `reference.reference_losses` on the same global batches. Measured on torch 2.13 / CPU
(8 steps, tiny Llama, loss ~5.5): fp32 max |diff| 9.5e-7 (2 ulp), bf16 9.7e-5, bf16_pure 9.7e-5,
fp16 1.3e-5. The tolerances below are about 2-3x those.
"""

from __future__ import annotations

import json

import pytest
from conftest import check_ok, train
from omegaconf import OmegaConf
from reference import reference_run

from fsdp_lab.config import to_typed
from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow

FP32_TOL = 2e-6
# Relative gradient-norm tolerance by compute dtype (fp32 measured <= 1e-6; bf16 ~1e-2).
NORM_RTOL = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
STEPS = 8


def run_and_compare(run_dir, world: int, *overrides: str) -> tuple[float, dict]:
    check_ok(
        train(
            run_dir,
            f"hardware.nproc_per_node={world}",
            f"trainer.max_steps={STEPS}",
            "hardware=cpu",
            *overrides,
        )
    )
    return compare(run_dir, world)


def compare(run_dir, world: int, reference: dict | None = None) -> tuple[float, dict]:
    """(max |loss - reference loss| over the steps, run.json) of a finished run; ``reference``
    overrides the reference's config (another layout of the same global batch)."""
    cfg = to_typed(OmegaConf.load(run_dir / "config.yaml"))
    records = read_metrics(run_dir / "metrics.jsonl")
    ref_cfg = cfg if reference is None else to_typed(OmegaConf.merge(cfg, reference))
    want, want_norms = reference_run(ref_cfg, world_size=world if reference is None else 1)
    assert len(records) == len(want) == STEPS
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and facts["world_size"] == world
    # The global gradient norm (over every rank's shards) is what clipping uses: it must be the
    # unsharded model's norm, not one rank's part of it.
    norm_diff = max(abs(r["grad_norm"] - n) / n for r, n in zip(records, want_norms, strict=True))
    assert norm_diff <= NORM_RTOL[cfg.precision.param_dtype.name], norm_diff
    return max(abs(r["loss"] - w) for r, w in zip(records, want, strict=True)), facts


@pytest.mark.parametrize(
    "strategy,world,shard_ways",
    [
        ("full", 2, 2),
        ("grad_op", 2, 2),
        ("no_shard", 2, 1),
        ("hybrid", 4, 2),
        ("hybrid_zero2", 4, 2),
    ],
)
def test_every_strategy_matches_one_unsharded_process(shared_run, strategy, world, shard_ways):
    diff, facts = compare(shared_run(f"{strategy}-{world}"), world)
    assert diff <= FP32_TOL, f"{strategy}: max |loss diff| {diff:.2e}"
    # Each rank stores 1/shard_ways of every parameter (dim-0 chunks; sizes here divide evenly).
    total = facts["total_params"]
    assert facts["local_params_per_rank"] == [total // shard_ways] * world
    expected_mesh = {
        "full": [2],
        "grad_op": [2],
        "no_shard": [2, 1],
        "hybrid": [2, 2],
        "hybrid_zero2": [2, 2],
    }[strategy]
    assert facts["mesh_shape"] == expected_mesh


@pytest.mark.parametrize("precision,tol", [("bf16", 3e-4), ("bf16_pure", 3e-4), ("fp16", 5e-5)])
def test_mixed_precision_stays_close_to_fp32_reference(run_dir, precision, tol):
    diff, _ = run_and_compare(run_dir, 2, "sharding=full", f"precision={precision}")
    assert diff <= tol, f"{precision}: max |loss diff| {diff:.2e}"
    # A policy that silently did nothing would match fp32 exactly.
    assert diff > FP32_TOL


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=qwen2_tiny",),  # tied embeddings, sharded in the root unit
        ("model=gpt2_tiny", "wrap=none"),
        ("trainer.grad_accum_steps=3", "hardware.start_method=spawn"),  # ranks exec, not fork
        ("offload=cpu",),
        ("wrap=size", "wrap.min_num_params=5000"),
        ("sharding.reshard_after_forward=false",),
        ("optim.grad_clip=0.05",),  # clipping active on every step (norms are ~0.7)
        ("model=bert_tiny",),  # masked LM: the ranks' masks differ; one mean over all masked
        ("data=shakespeare", "trainer.seq_len=32"),  # packed text, each rank its own rows
        ("activation_checkpointing=full",),
        ("activation_checkpointing=op",),  # torchtitan's op-level policy under FSDP2
    ],
    ids=lambda o: ",".join(o),
)
def test_models_and_knobs_match_the_reference(run_dir, overrides):
    diff, _ = run_and_compare(run_dir, 2, "sharding=full", *overrides)
    assert diff <= FP32_TOL, f"{overrides}: max |loss diff| {diff:.2e}"


def test_accumulation_trains_on_the_rows_of_one_big_micro_batch(run_dir):
    # 2 ranks x 2 accumulated micro-batches of 1 row against one process taking the step's 4
    # rows at once: the synthetic stream deals one global batch, whatever the layout.
    check_ok(
        train(
            run_dir,
            "hardware.nproc_per_node=2",
            f"trainer.max_steps={STEPS}",
            "hardware=cpu",
            "trainer.grad_accum_steps=2",
            "trainer.micro_batch_size=1",
        )
    )
    one = {"trainer": {"grad_accum_steps": 1, "micro_batch_size": 4}}
    diff, _ = compare(run_dir, 2, reference=one)
    assert diff <= FP32_TOL, f"max |loss diff| {diff:.2e}"


# Mixtures of experts: the step's objective includes the router's aux loss, the global
# micro-batch's (all-reduced over ranks), which the reference computes with transformers' own
# load_balancing_loss_func on the concatenated rows.
MOE_RUN = ("trainer.eval_every=0",)


@pytest.mark.parametrize(
    "strategy,world",
    [("full", 2), ("grad_op", 2), ("no_shard", 2), ("hybrid", 4), ("hybrid_zero2", 4)],
)
def test_moe_under_every_strategy_matches_one_unsharded_process(run_dir, strategy, world):
    overrides = (f"sharding={strategy}", "model=qwen3_moe_tiny", "trainer.seq_len=32", *MOE_RUN)
    diff, facts = run_and_compare(run_dir, world, *overrides)
    assert diff <= FP32_TOL, f"{strategy}: max |loss diff| {diff:.2e}"
    assert facts["active_params"] < facts["total_params"]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert all(r["aux_loss"] > 0 and r["expert_load_imbalance"] >= 1 for r in records)


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=mixtral_tiny", "trainer.seq_len=32"),
        # the aux loss: a mean over micro-batches
        ("model=olmoe_tiny", "trainer.seq_len=32", "trainer.grad_accum_steps=2"),
        # top-1 of 16 experts, 8 tokens a rank: most experts get no token on a rank, some none
        # at all in the global batch (a layer's max/mean load > 1 with a mean of 1 token)
        (
            "model=qwen3_moe_tiny",
            "model.num_experts=16",
            "model.experts_per_token=1",
            "trainer.micro_batch_size=1",
            "trainer.seq_len=9",
            "activation_checkpointing=full",
        ),
    ],
    ids=lambda o: ",".join(o),
)
def test_moe_models_match_the_reference(run_dir, overrides):
    diff, _ = run_and_compare(run_dir, 2, "sharding=full", *MOE_RUN, *overrides)
    assert diff <= FP32_TOL, f"{overrides}: max |loss diff| {diff:.2e}"
    records = read_metrics(run_dir / "metrics.jsonl")
    if "model.experts_per_token=1" in overrides:
        assert max(r["expert_load_imbalance"] for r in records) > 1


def test_training_learns(shared_run):
    """Beyond parity: the default recipe actually trains (loss falls well below log(256)=5.55)."""
    losses = [r["loss"] for r in read_metrics(shared_run("long") / "metrics.jsonl")]
    assert losses[0] > 5.4 and losses[-1] < 4.0
