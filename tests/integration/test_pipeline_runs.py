"""Pipeline parallelism in whole runs on real gloo ranks, against one unsharded process (fp32,
8 steps, gradient norms included): PP 2 under 1F1B with accumulation, Interleaved1F1B (two
stages a rank) with LoRA, GPipe x full sharding 2, PP 4; a run resumed across pipeline sizes;
a family the split cannot serve, refused before launch.

Measured on torch 2.13 / 2 CPU cores: within 1e-6 of the reference's loss and 2e-7 relative in
the gradient norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import check_ok, run_python, train
from reference import compare, losses, reference_run

from fsdp_lab.config import compose
from fsdp_lab.observe.run_logs import read_metrics
from fsdp_lab.state import checkpoint as ckpt

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]

FP32_TOL, NORM_RTOL, STEPS = 1e-5, 1e-5, 8


@pytest.mark.parametrize(
    "world,overrides,mesh",
    [
        # two micro-batches accumulated, each cut into 2 microbatches
        (2, ("parallel.pipeline=2", "trainer.grad_accum_steps=2"), {"pp": 2, "shard": 1}),
        # two stages a rank (4 in all), LoRA adapters on a frozen base
        (
            2,
            (
                "parallel.pipeline=2",
                "parallel.pipeline_schedule=Interleaved1F1B",
                "model.num_layers=4",
                "finetune=lora",
            ),
            {"pp": 2, "shard": 1},
        ),
        # each stage sharded over 2 ranks
        (
            4,
            ("parallel.pipeline=2", "parallel.pipeline_schedule=GPipe", "sharding=full"),
            {"pp": 2, "shard": 2},
        ),
        (4, ("parallel.pipeline=4", "model.num_layers=4"), {"pp": 4, "shard": 1}),
        # each stage 2 replicas of 2 shards
        (8, ("parallel.pipeline=2", "sharding=hybrid"), {"pp": 2, "replicate": 2, "shard": 2}),
        # a stage's layers split over a TP pair; with V stages, rank 0 holds no decoder layer
        (
            4,
            (
                "parallel.pipeline=2",
                "parallel.tensor=2",
                "parallel.pipeline_schedule=ZBVZeroBubble",
                "sharding=grad_op",
                "model.num_layers=4",
            ),
            {"pp": 2, "shard": 1, "tp": 2},
        ),
        # a stage's sequences split over a CP pair
        (4, ("parallel.pipeline=2", "parallel.context=2"), {"pp": 2, "shard": 1, "context": 2}),
    ],
    ids=[
        "1f1b-accum2",
        "interleaved-lora",
        "gpipe-x-full2",
        "pp4",
        "pp2-x-hybrid2x2",
        "zbv-x-tp2",
        "pp2-x-cp2",
    ],
)
def test_pp_matches_one_unsharded_process(run_dir, world, overrides, mesh):
    check_ok(
        train(
            run_dir,
            "hardware=cpu",
            f"hardware.nproc_per_node={world}",
            f"trainer.max_steps={STEPS}",
            "trainer.eval_every=0",
            "checkpoint=none",
            "logger=none",
            *overrides,
        )
    )
    dp = mesh.get("replicate", 1) * mesh["shard"]  # a stage's ranks read different rows
    facts = compare(run_dir, dp=dp, steps=STEPS)
    assert dict(zip(facts["mesh_axes"], facts["mesh_shape"], strict=True)) == mesh
    accum = 2 if "trainer.grad_accum_steps=2" in overrides else 1
    assert facts["tokens_per_step"] == dp * accum * 4 * 64  # each token once, not per stage
    # each tensor on one stage's ranks only; a rank about 1/pp of it (the first and last stages
    # hold a decoder layer fewer: the embedding and the head count as one each); FSDP shards a
    # stage over shard x context, TP splits its layers
    held = facts["local_params_per_rank"]
    split = mesh["shard"] * mesh.get("context", 1) * mesh.get("tp", 1)
    assert sum(held) >= facts["total_params"] * (1 if dp == 1 else 0.99)
    assert max(held) * mesh["pp"] * split < facts["total_params"] * 2


SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


def test_every_schedule_matches_one_unsharded_process(tmp_path):
    """PP 2 under each of torch's seven schedules (two stages a rank for all but GPipe and 1F1B),
    in one process group: every step's loss and gradient norm equal one process's. The
    zero-bubble ones keep the weights gathered (grad_op) and the model's own loss (the rules
    ask for both)."""
    overrides = ("parallel.pipeline=2", "model.num_layers=4", "sharding=grad_op", "loss=hf")
    steps = 4
    proc = run_python(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(TESTS / "pipeline_ranks.py"),
            str(tmp_path),
            str(steps),
            ",".join(SCHEDULES),
            *overrides,
        ],
        timeout=300,
    )
    check_ok(proc)
    cfg = compose(["hardware=cpu", f"trainer.max_steps={steps}", *overrides])
    want, want_norms = reference_run(cfg, world_size=1)
    for schedule in SCHEDULES:
        records = json.loads((tmp_path / f"{schedule}.json").read_text())["records"]
        diff = max(abs(r["loss"] - w) for r, w in zip(records, want, strict=True))
        norm = max(abs(r["grad_norm"] - n) / n for r, n in zip(records, want_norms, strict=True))
        assert diff <= FP32_TOL and norm <= NORM_RTOL, (schedule, diff, norm)


def test_packed_chat_is_exact(tmp_path, bpe_tokenizer):
    """Chat conversations packed several to a row (each query sees only its own: the masks are
    built in every stage from the row's sequence index) and only replies trained on, with
    activation checkpointing: PP 2 equals one process step by step."""
    chats = tmp_path / "chats.jsonl"
    with chats.open("w") as f:
        for i in range(300):  # short exchanges: about 3 a row of 256 tokens
            user = f"Say line {i} of the play, " + "briefly " * (i % 7)
            reply = f"Line {i}: to be " + "or not " * (i % 5)
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": messages}) + "\n")
    packed = tmp_path / "packed"
    check_ok(
        train(
            packed,
            "hardware=cpu",
            "hardware.nproc_per_node=2",
            "parallel.pipeline=2",
            "logger=none",
            f"trainer.max_steps={STEPS}",
            "trainer.eval_every=0",
            "checkpoint=none",
            "data=chat",
            f"data.files={chats}",
            f"data.tokenizer={bpe_tokenizer}",
            "data.chat_template=conf/chat_templates/chatml.jinja",
            f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.seq_len=256",
            "model.max_position_embeddings=256",
            "trainer.micro_batch_size=2",
            "activation_checkpointing=full",
        )
    )
    compare(packed, dp=1, steps=STEPS)


def test_a_lora_run_resumes_bit_exact(tmp_path):
    """Each stage's optimizer groups differ (a stage with no 1-D trainable parameter has one):
    the checkpoint keys their settings by parameter name, so each reads back its own."""
    common = ("hardware=cpu", "hardware.nproc_per_node=2", "parallel.pipeline=2", "logger=none")
    common += ("finetune=lora", "trainer.max_steps=4", "checkpoint.every_n_steps=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check_ok(train(straight, *common))
    at2 = straight / "checkpoints" / ckpt.step_dir_name(2)
    check_ok(train(resumed, *common, f"resume={at2}"))
    want, got = losses(straight), losses(resumed)
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), (got, want)


def test_qlora_equals_its_one_process_run(tmp_path):
    """An NF4 base: each stage quantises its own tensors (the absmax mean over a tensor's own
    mesh, not the world's, which holds other stages' tensors) and trains LoRA on it exactly as
    one process does."""
    common = ("hardware=cpu", "finetune=qlora", "model.num_layers=4", "logger=none")
    common += (f"trainer.max_steps={STEPS}", "trainer.eval_every=0", "checkpoint=none")
    runs = {n: tmp_path / f"pp{n}" for n in (1, 2)}
    check_ok(train(runs[1], *common, "hardware.nproc_per_node=1"))
    check_ok(train(runs[2], *common, "hardware.nproc_per_node=2", "parallel.pipeline=2"))
    one, two = (read_metrics(runs[n] / "metrics.jsonl") for n in (1, 2))
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"], (a, b)


def _weights(directory) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_a_checkpoint_resumes_across_pipeline_sizes(tmp_path):
    """PP 2 (2 ranks) -> PP 1 (1 rank) -> PP 4 (4 ranks): the tensors keep the unsplit model's
    names, so DCP reads each rank's stages from any split, and every resumed step is the
    uninterrupted run's; the validation after the last step is the same at each size."""
    common = ("hardware=cpu", "trainer.max_steps=9", "trainer.eval_every=9", "logger=none")
    common += ("checkpoint.every_n_steps=3", "checkpoint.keep_last=3", "model.num_layers=4")
    first, second, third = (tmp_path / n for n in ("pp2", "pp1", "pp4"))
    check_ok(train(first, *common, "hardware.nproc_per_node=2", "parallel.pipeline=2"))
    at3 = first / "checkpoints" / ckpt.step_dir_name(3)
    check_ok(train(second, *common, "hardware.nproc_per_node=1", f"resume={at3}"))
    at6 = second / "checkpoints" / ckpt.step_dir_name(6)
    check_ok(
        train(
            third,
            *common,
            "hardware.nproc_per_node=4",
            "parallel.pipeline=4",
            f"resume={at6}",
            "checkpoint.export_hf=true",
        )
    )
    want = losses(first)
    assert sorted(losses(second)) == list(range(4, 10))
    for run, steps in ((second, range(4, 7)), (third, range(7, 10))):
        got = losses(run)
        assert max(abs(got[s] - want[s]) for s in steps) <= FP32_TOL, (run.name, got, want)
    # the run's own export (each tensor sent to rank 0 by its stage) is the whole model, as
    # fsdp-lab export reads it from the last checkpoint in one process
    offline = tmp_path / "offline"
    check_ok(run_python(["-m", "fsdp_lab.tools.cli", "export", str(third), str(offline)]))
    ours, theirs = (_weights(d) for d in (third / "hf", offline))
    assert sorted(ours) == sorted(theirs) and len(ours) == 4 * 9 + 3
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    val = [read_metrics(run / "metrics.jsonl", "val")[-1] for run in (first, second, third)]
    assert {r["step"] for r in val} == {9} and len({r["val_tokens"] for r in val}) == 1
    assert max(abs(r["val_loss"] - val[0]["val_loss"]) for r in val) <= FP32_TOL, val


def test_a_model_the_split_cannot_serve_is_named_before_launch(run_dir):
    proc = train(
        run_dir,
        "hardware=cpu",
        "hardware.nproc_per_node=2",
        "parallel.pipeline=2",
        "model=gpt2_tiny",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and "model_type=gpt2" in errors[0] and "Traceback" not in proc.stderr
    assert not (run_dir / "checkpoints").exists()
