"""fsdp-lab plan against real CPU runs: each rank's state exactly, the step's peak within 5%."""

from __future__ import annotations

import json

import pytest
from conftest import check_ok, train
from plan_cases import BIG_VOCAB, LOCAL, LOCAL_CONFIGS, MEDIUM

from fsdp_lab.planning import plan

pytestmark = pytest.mark.slow

# glibc's dynamic mmap threshold keeps freed activation memory in the heap, so the RSS high-water
# mark overstates live tensors up to 2x (measured: 543 MB of RSS for a 263 MB live peak); pinned,
# large tensors are mmapped and returned when freed.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# Measured peak RSS - RSS before the first step, over the estimate: 1.01-1.14 over Llama,
# Mistral, Qwen2, GPT-2 and BERT, full, grad_op, no_shard and hybrid, fp32 and bf16, always
# 8-25 MiB over. Live tensor bytes are within 0-4% (the fake-group test in
# tests/unit/planning/test_plan.py): the rest is the process's, not tensors (what the first steps
# page in: libraries, oneDNN's workspaces, malloc arenas), listed as not counted.
# So: tensors within 5%, plus up to 48 MiB of the process's own.
RSS_TOLERANCE, RSS_SLACK = 0.05, 48 * 2**20


@pytest.mark.parametrize(
    "base,overrides",
    [
        (MEDIUM, ["sharding=full"]),
        (MEDIUM, ["sharding=grad_op"]),
        (MEDIUM, ["sharding=hybrid", "hardware.nproc_per_node=4"]),
        (MEDIUM, ["sharding=full", "precision=bf16"]),
        # dp 2 x tp 2 with sequence parallelism: measured 151 MiB over the state against 133
        # planned (1.13; TP's redistribution buffers are not modelled), within the slack
        (
            MEDIUM,
            ["hardware.nproc_per_node=4", "parallel.tensor=2", "parallel.sequence_parallel=true"],
        ),
        # One per architecture whose root unit (embeddings, head) outweighs its layers, 6 s
        # each. Before the root's end of backward was modelled the plan added the root's
        # gradient buffers to all the activations, and these failed here: measured 0.93x of it
        # (gpt2, llama, mistral), 0.94x (qwen2 no_shard); bert's 1.21x passed on the slack.
        (BIG_VOCAB, ["model=gpt2_tiny", "model.num_heads=4", "sharding=full"]),
        # untied: the head's V x H gradient outlives the copy into the reduce-scatter, and gloo
        # clones the root's whole reduce-scatter input (the peak)
        (BIG_VOCAB, ["sharding=full"]),
        (BIG_VOCAB, ["model=qwen2_tiny", "sharding=no_shard"]),
        # the model's own loss, tied: three V x H gradients in the embedding's backward (the peak)
        (BIG_VOCAB, ["model=bert_tiny", "sharding=grad_op"]),
        # expert parallelism: EP 2 x FSDP 2, 8 experts of width 256 split on both axes
        (
            MEDIUM,
            [
                "model=qwen3_moe_tiny",
                "model.expert_intermediate_size=256",
                "parallel.expert=2",
                "hardware.nproc_per_node=4",
            ],
        ),
        # a pipeline: each rank's stages exactly; rank 0 holds its two microbatches' layers
        # (1F1B), the last stage one and the head (measured 1.07x and 1.19x of the plan)
        (MEDIUM, ["parallel.pipeline=2", "hardware.nproc_per_node=2"]),
        (
            MEDIUM,
            [
                "parallel.pipeline=2",
                "parallel.pipeline_schedule=GPipe",
                "hardware.nproc_per_node=4",
            ],
        ),
    ],
    ids=[
        "full",
        "grad_op",
        "hybrid",
        "full-bf16",
        "dp2xtp2-sp",
        "gpt2-big-vocab",
        "llama-big-vocab",
        "qwen2-big-vocab-no_shard",
        "bert-big-vocab-grad_op",
        "qwen3-moe-ep2xfsdp2",
        "pp2-1f1b",
        "pp2-gpipe-x-full2",
    ],
)
def test_measured_runs_match_the_plan(run_dir, base, overrides):
    check_run_against_plan(run_dir, [*base, *overrides])


def test_a_mistral_directory_matches_the_plan(run_dir, tmp_path):
    """An architecture with no preset (model=local, random init): planned as a Llama."""
    from transformers import MistralConfig

    MistralConfig(
        vocab_size=32768,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path / "mistral")
    check_run_against_plan(
        run_dir,
        [
            *[a for a in BIG_VOCAB if not a.startswith("model.")],
            "model=local",
            f"model.name_or_path={tmp_path / 'mistral'}",
            "model.pretrained=false",
        ],
    )


def check_run_against_plan(run_dir, overrides: list[str]) -> None:
    """Two steps of train.py: each rank's state exactly the plan's, its peak within tolerance."""
    args = [*overrides, "trainer.max_steps=2", "trainer.eval_every=0", "checkpoint=none"]
    check_ok(train(run_dir, *args, env=MALLOC_ENV))
    run = json.loads((run_dir / "run.json").read_text())
    expected = plan.build_plan(args)
    s = expected.chosen_plan
    assert len(run["state_bytes_per_rank"]) == expected.world_size
    for rank, measured in enumerate(run["state_bytes_per_rank"]):
        mine = s.per_rank[rank]
        assert measured == dict(params=mine.params, grads=mine.grads, optimizer=mine.optimizer)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for rank, before in enumerate(run["memory_before_train_bytes_per_rank"]):
        peak = max(r["peak_mem_bytes_per_rank"][rank] for r in steps if r["split"] == "train")
        estimate = s.peak_over_start(rank)
        assert (
            (1 - RSS_TOLERANCE) * estimate
            <= peak - before
            <= (1 + RSS_TOLERANCE) * estimate + RSS_SLACK
        ), (rank, peak - before, estimate, (peak - before) / estimate)


@pytest.mark.parametrize("name", sorted(LOCAL_CONFIGS))
def test_a_local_directory_matches_the_plan(run_dir, tmp_path, name):
    """Layouts with no preset, as a user's config.json gives them: GPT-2 with its default
    dropout (measured 1.32x the plan before dropout was modelled: 805 MiB against 611; now
    1.03x) and NeoX (0.87x when planned as a Llama: 553 MiB against 635; now 1.03x)."""
    LOCAL_CONFIGS[name]().save_pretrained(tmp_path / name)
    check_run_against_plan(run_dir, [*LOCAL, f"model.name_or_path={tmp_path / name}"])
