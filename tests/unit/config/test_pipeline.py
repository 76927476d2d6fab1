"""Pipeline parallelism's table and layout (``config.pipeline``), the rules that refuse what
it does not run yet, and the cut a rank's model takes (``engine.pipeline``), on meta."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_lab.config import ConfigError
from fsdp_lab.config.hardware import HardwareKind
from fsdp_lab.config.load import compose
from fsdp_lab.config.pipeline import SCHEDULES, layout, split_layers
from fsdp_lab.config.rules import validate
from fsdp_lab.config.topology import Topology, stage_topology


def test_the_even_split_counts_the_embedding_and_the_head_as_a_layer_each():
    assert split_layers(2, 2) == ((0,), (1,))
    assert split_layers(6, 2) == ((0, 1, 2), (3, 4, 5))
    assert split_layers(8, 4) == ((0,), (1, 2, 3), (4, 5, 6), (7,))
    assert split_layers(4, 4) == ((), (0, 1), (2, 3), ())
    for layers, stages in ((30, 4), (7, 3), (16, 8)):
        cut = split_layers(layers, stages)
        assert [i for s in cut for i in s] == list(range(layers))
        sizes = [len(s) + (i in (0, stages - 1)) for i, s in enumerate(cut)]
        assert max(sizes) - min(sizes) <= 1


def _parallel(**fields):
    return dataclasses.replace(compose([]).parallel, pipeline=2, **fields)


def test_a_layout_places_stages_by_the_schedules_placement():
    loop = layout(_parallel(pipeline_schedule="Interleaved1F1B"), 8, 4)
    assert loop.stages == 4 and [loop.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert loop.stages_of(1) == [1, 3]
    one = layout(_parallel(), 8, 4)
    assert one.stages == 2 and one.microbatches == 2
    given = layout(_parallel(pipeline_layers=[5, 3]), 8, 4)
    assert given.layers == ((0, 1, 2, 3, 4), (5, 6, 7))


@pytest.mark.parametrize(
    "fields,layers,micro,words",
    [
        (dict(pipeline_schedule="Nope"), 8, 4, "is not a schedule"),
        (dict(stages_per_rank=2), 8, 4, "one stage a rank"),
        (dict(), 1, 4, "more than the model's 1 layers"),
        (dict(pipeline_microbatches=3), 8, 4, "does not divide trainer.micro_batch_size=4"),
        (dict(pipeline_microbatches=1), 8, 4, "needs at least the 2 stages"),
        (dict(pipeline_layers=[4, 3]), 8, 4, "8 in all"),
    ],
)
def test_a_layout_the_schedule_cannot_run_is_one_line_naming_the_setting(
    fields, layers, micro, words
):
    with pytest.raises(ConfigError) as e:
        layout(_parallel(**fields), layers, micro)
    assert words in str(e.value) and "\n" not in str(e.value) and "parallel." in str(e.value)


def test_the_bubble_shrinks_with_microbatches_and_virtual_stages():
    one = SCHEDULES["1f1b"]
    assert one.bubble(4, 2, 1) == pytest.approx(1 / 5)
    assert one.bubble(8, 2, 1) < one.bubble(4, 2, 1)
    assert SCHEDULES["interleaved1f1b"].bubble(4, 2, 2) < one.bubble(4, 2, 1)
    assert one.bubble(4, 1, 1) == 0.0


def test_a_stage_is_contiguous_ranks_and_the_rules_apply_within_it():
    topo = Topology.nodes(4, 2, HardwareKind.cpu)
    assert stage_topology(topo, 2) == Topology(4, 4, 1, HardwareKind.cpu)
    assert stage_topology(Topology.nodes(4, 1, HardwareKind.cpu), 2).nproc_per_node == 2
    cfg = compose(["parallel.pipeline=2", "sharding=hybrid"])
    validate(cfg, Topology.nodes(8, 1, HardwareKind.cpu))  # 2 stages of 2 x 2
    with pytest.raises(ConfigError, match="leaves shard groups of 1 rank"):
        validate(cfg, Topology.nodes(4, 1, HardwareKind.cpu))
    with pytest.raises(ConfigError, match="does not divide the 3 ranks"):
        validate(compose(["parallel.pipeline=2"]), Topology.nodes(3, 1, HardwareKind.cpu))


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["parallel.tensor=2", "parallel.sequence_parallel=true"], "sequence_parallel"),
        (
            ["compile=true", "parallel.pipeline_schedule=ZBVZeroBubble", "sharding=grad_op"],
            "compile=false",
        ),
        (["model=qwen3_moe_tiny"], "mixture of experts"),
        (["model.loading=rank0"], "model.loading=rank0"),
        (["parallel.pipeline=1", "parallel.pipeline_microbatches=2"], "applies only"),
        (["parallel.pipeline_schedule=ZBVZeroBubble"], "sharding=full reshards them"),
        (
            ["parallel.pipeline_schedule=DualPipeV", "sharding=grad_op", "loss=chunked"],
            "loss=chunked's backward computes both at once",
        ),
    ],
)
def test_what_pipeline_does_not_run_yet_is_refused_in_one_line(overrides, words):
    cfg = compose(["parallel.pipeline=2", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, Topology.nodes(4, 1, HardwareKind.cpu))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_rank_keeps_its_stages_under_the_unsplit_names():
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.engine import pipeline

    cfg = compose(["parallel.pipeline=2", "model.num_layers=4"])
    hf = model_lib.build_hf_config(cfg.model)
    whole = dict(model_lib.model_on_meta(hf, cfg.model.task, cfg.finetune).named_parameters())
    stages = pipeline.check(hf, cfg.parallel, cfg.trainer.micro_batch_size)
    names = []
    for rank in range(2):
        model = model_lib.model_on_meta(hf, cfg.model.task, cfg.finetune)
        layers, embed, head = pipeline.rank_layers(stages, rank)
        pipeline.keep(model, layers, embed=embed, head=head)
        held = dict(model.named_parameters())
        assert all(whole[n].shape == p.shape for n, p in held.items())
        names += held
        assert ("model.embed_tokens.weight" in held) == (rank == 0)
        assert ("lm_head.weight" in held) == (rank == 1)
    assert sorted(names) == sorted(whole)  # every tensor once, on one stage


@pytest.mark.parametrize(
    "overrides,words",
    [(["model.tie_word_embeddings=true"], "tie_word_embeddings"), (["model=gpt2_tiny"], "gpt2")],
)
def test_a_model_the_cut_cannot_serve_is_refused_in_one_line(overrides, words):
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.engine import pipeline

    cfg = compose(["parallel.pipeline=2", *overrides])
    with pytest.raises(ConfigError) as e:
        pipeline.check(model_lib.build_hf_config(cfg.model), cfg.parallel, 4)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_frozen_base_needs_a_decoder_layer_on_every_pipeline_rank():
    """With LoRA a rank holding the embedding or the head alone would train nothing (its
    optimizer would hold no state to checkpoint): refused, and a given split that gives every
    rank a layer runs."""
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.engine import pipeline

    args = ["parallel.pipeline=2", "parallel.pipeline_schedule=ZBVZeroBubble", "model.num_layers=4"]
    cfg = compose(args)
    hf = model_lib.build_hf_config(cfg.model)
    pipeline.check(hf, cfg.parallel, 4)  # full training: the embedding and head train
    with pytest.raises(ConfigError, match="pipeline rank 0 holds no decoder layer"):
        pipeline.check(hf, cfg.parallel, 4, frozen_base=True)
    given = compose([*args, "parallel.pipeline_layers=[1,1,1,1]"])
    pipeline.check(hf, given.parallel, 4, frozen_base=True)
