"""fsdp-lab tune without running anything: the grid, the command, the one-line refusals."""

from __future__ import annotations

import pytest

from fsdp_lab.config import ActivationCheckpointingMode, ConfigError, ShardingStrategy
from fsdp_lab.planning import tune, tune_probes
from fsdp_lab.tools import cli

AC = ActivationCheckpointingMode


def test_the_gpu_grid_has_every_axis_and_the_cpu_grid_drops_offload():
    gpu, device, world = tune.enumerate_candidates(["hardware=gpu", "hardware.nproc_per_node=8"], 4)
    assert (device.name, world) == ("gpu", 8)
    axes = {(c.strategy, c.ac, c.offload, c.micro_batch, c.tensor) for c in gpu}
    # strategies x ac (4) x offload x micro-batch 1,2,4 x TP 1,2 (4 and 8: the tiny Llama's 2 KV
    # heads do not divide, the plan refuses them)
    assert len(axes) == len(gpu) == 5 * 4 * 2 * 3 * 2
    assert {c.tensor for c in gpu} == {1, 2}
    tp2 = next(c for c in gpu if c.tensor == 2)
    assert "parallel.tensor=2" in tp2.overrides()
    cpu, _, _ = tune.enumerate_candidates(["hardware=cpu"], 4)
    assert not any(c.offload for c in cpu)  # offload moves nothing on a CPU rank
    # hybrid needs 4+ ranks: on 2 it is not a candidate
    assert {c.strategy for c in cpu} == {
        ShardingStrategy.full,
        ShardingStrategy.grad_op,
        ShardingStrategy.no_shard,
    }
    # more activations, more memory; checkpointing saves some; the prior prefers no recompute
    by = {(c.strategy, c.ac, c.micro_batch): c for c in cpu if c.tensor == 1}
    full, none, ac_full = ShardingStrategy.full, AC.none, AC.full
    assert by[full, none, 4].plan_peak_bytes > by[full, none, 1].plan_peak_bytes
    assert by[full, ac_full, 4].plan_peak_bytes < by[full, none, 4].plan_peak_bytes
    # the time model predicts recomputation costs time
    assert by[full, none, 4].prior < by[full, ac_full, 4].prior
    assert by[full, none, 4].predicted_step_s < by[full, ac_full, 4].predicted_step_s


def test_a_bf16_gpu_run_is_offered_float8_where_torchao_is_installed():
    pytest.importorskip("torchao")
    args = ["hardware=gpu", "hardware.nproc_per_node=2", "precision=bf16"]
    cands, _, _ = tune.enumerate_candidates(args, 2)
    f8 = [c for c in cands if c.float8]
    # every bf16 candidate once more in float8, but with TP or offload (refused with float8)
    plain = [c for c in cands if not c.float8 and c.tensor == 1 and not c.offload]
    assert f8 and len(f8) == len(plain) and not any(c.tensor > 1 or c.offload for c in f8)
    assert "precision.float8_recipe=tensorwise" in f8[0].overrides()
    twin = next(c for c in cands if not c.float8 and c.overrides() == f8[0].overrides()[:-1])
    # this tiny model's GPU step is bound by launching its kernels, which float8 does not
    # shorten (its casts add a few: a 1B model's is shortened, tests/unit/tools/test_time_model)
    assert f8[0].prior == pytest.approx(twin.prior, rel=0.05)
    # fp32 runs, CPU runs and runs that chose their precision's float8 setting are not.
    for other in (
        ["hardware=gpu", "hardware.nproc_per_node=2"],
        ["hardware=cpu", "precision=bf16"],
        [*args, "precision.float8_recipe=rowwise"],
    ):
        assert not any(c.float8 for c in tune.enumerate_candidates(other, 2)[0])


def test_overrides_hold_an_axis_and_the_grid_restricts_the_others():
    cands, _, _ = tune.enumerate_candidates(
        ["hardware=cpu", "sharding=grad_op", "parallel.tensor=1"],
        8,
        tune.Grid.parse(None, "none,full", "2,8", "2"),  # --tensor 2, but the override holds 1
    )
    assert {(c.strategy.name, c.ac.name, c.micro_batch) for c in cands} == {
        ("grad_op", ac, mb) for ac in ("none", "full") for mb in (2, 8)
    }


@pytest.mark.parametrize(
    "args,message",
    [
        (("full,zero3", None, None), "--sharding full,zero3: use a comma list of full"),
        ((None, "some", None), "--checkpointing some: use a comma list of none, op, selective"),
        ((None, None, "2,x"), "--micro-batches 2,x: use a comma list of sizes >= 1"),
        ((None, None, "0"), "--micro-batches 0: use a comma list of sizes >= 1"),
        ((None, None, None, "2,"), "--tensor 2,: use a comma list of sizes >= 1"),
    ],
)
def test_a_bad_grid_is_one_line(args, message):
    with pytest.raises(ConfigError, match="^" + message):
        tune.Grid.parse(*args)


def test_the_command_replaces_the_axes_the_overrides_held():
    c = tune.Candidate(ShardingStrategy.no_shard, AC.full, False, 8)
    cmd = tune.command(["sharding=full", "model.hidden_size=64", "trainer.seq_len=128"], c, [])
    assert cmd == (
        "fsdp-lab train model.hidden_size=64 trainer.seq_len=128 sharding=no_shard "
        "activation_checkpointing=full offload=none trainer.micro_batch_size=8"
    )
    host = [tune_probes.MALLOC_OVERRIDE]
    assert tune.command([], c, host).endswith(" hardware.malloc_mmap_threshold=131072")


def test_nothing_fits_names_the_smallest_peak_and_what_would_help(tmp_path):
    with pytest.raises(ConfigError) as e:
        tune.tune(["hardware=cpu"], 0.01, out_dir=tmp_path / "t", max_micro_batch=2)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("nothing fits in 0.01 GiB per rank on 2 rank(s): the smallest planned")
    assert "activation_checkpointing=full" in line  # the smallest is the most checkpointed
    assert "more ranks" in line and "offload=cpu" not in line  # offload: GPU only
    assert not (tmp_path / "t").exists()


def test_probes_that_all_fail_give_their_reason_not_a_memory_answer(tmp_path, monkeypatch):
    def refused(overrides, c, run_dir, **kw):
        c.run_dir, c.verdict = str(run_dir), "failed: hardware=gpu but CUDA is not available"

    monkeypatch.setattr(tune, "probe", refused)
    monkeypatch.setattr(tune, "process_baseline_bytes", lambda device: 300 * tune.MIB)
    with pytest.raises(ConfigError) as e:
        tune.tune(["hardware=cpu"], 4, out_dir=tmp_path / "t", max_micro_batch=2, probes=2)
    assert str(e.value) == (
        f"all 2 probe(s) failed before measuring anything; the first ({tmp_path / 't'}/probe-0): "
        "hardware=gpu but CUDA is not available"
    )


def test_keep_global_batch_makes_up_each_micro_batch_with_accumulation():
    overrides = ["hardware=cpu", "hardware.nproc_per_node=4", "trainer.grad_accum_steps=2"]
    cands, _, world = tune.enumerate_candidates(overrides, 32, tune.Grid(keep_global_batch=True))
    # 4 per rank x 2 steps x 4 ranks = 32 sequences per optimizer step, for every candidate
    assert {c.micro_batch * c.grad_accum * (world // c.tensor) for c in cands} == {32}
    assert {(c.micro_batch, c.tensor) for c in cands} >= {(8, 1), (16, 2), (1, 2)}
    assert not any(c.micro_batch == 32 for c in cands)  # more than a rank's share
    c = next(c for c in cands if (c.micro_batch, c.tensor) == (2, 1))
    assert tune.command(overrides, c, {}).endswith(
        "trainer.micro_batch_size=2 trainer.grad_accum_steps=4"
    )
    free, _, _ = tune.enumerate_candidates(overrides, 32)  # without: the micro-batch alone varies
    assert {c.grad_accum for c in free} == {None} and any(c.micro_batch == 32 for c in free)


def test_the_top_three_are_probed_and_the_measured_order_picks_the_winner(tmp_path, monkeypatch):
    # The model predicts the candidates' tokens/s; the probes "measure" the reverse order for
    # the first two: every one of the top 3 runs, the measured fastest wins, tune says the
    # order was wrong, and the 4th is not probed.
    measured = iter([1000.0, 3000.0, 500.0])

    def fake_probe(overrides, c, run_dir, **kw):
        c.run_dir, c.verdict = str(run_dir), "fits"
        c.measured_bytes, c.tokens_per_s = c.planned_bytes, next(measured)

    monkeypatch.setattr(tune, "probe", fake_probe)
    monkeypatch.setattr(tune, "process_baseline_bytes", lambda device: 300 * tune.MIB)
    said = []
    out = tmp_path / "t"
    result = tune.tune(["hardware=cpu"], 4, out_dir=out, max_micro_batch=4, log=said.append)
    probed = [c for c in result.candidates if c.tokens_per_s is not None]
    assert len(probed) == 3 and len(result.candidates) > 3
    first, second, _ = sorted(probed, key=lambda c: c.prior)  # fastest predicted first
    assert first.predicted_tokens_per_s >= second.predicted_tokens_per_s
    assert result.winner is second  # measured 3000: the model's second
    assert len(result.order_errors) == 1 and result.order_errors[0].startswith(second.name)
    assert any(line.startswith("  the model's order was wrong: ") for line in said)
    assert any(c.verdict.startswith("not probed (beyond the 3 fastest") for c in result.candidates)
    table = tune.format_table(result)
    assert "measured/predicted" in table.splitlines()[0]
    ratio = f"{second.tokens_per_s / second.predicted_tokens_per_s:.2f}x"
    assert ratio in next(line for line in table.splitlines() if line.startswith("* "))


def test_order_errors_name_each_reversed_pair_of_probes_that_fit():
    def cand(predicted, measured, verdict="fits"):
        c = tune.Candidate(ShardingStrategy.full, AC.none, False, 1, prior=1 / predicted)
        c.predicted_tokens_per_s, c.tokens_per_s, c.verdict = predicted, measured, verdict
        return c

    a, b, c = cand(1000, 800.0), cand(900, 700.0), cand(500, 400.0)
    assert tune.probe_order([c, a, b]) == [a, b, c]
    assert tune.order_errors([a, b, c]) == []  # the order held
    fast = cand(400, 1000.0)
    assert len(tune.order_errors([a, b, fast])) == 2  # beat both it was predicted below
    # one over budget is not ranked
    assert tune.order_errors([a, cand(400, 1000.0, "over budget")]) == []


def test_a_global_batch_no_micro_batch_makes_up_is_one_line(capsys):
    # 4 per rank x 2 ranks: 8 sequences per step, less than one micro-batch of 16 per rank
    args = ["tune", "hardware=cpu", "--memory-gib", "1", "--micro-batches", "16,32"]
    assert cli.main([*args, "--keep-global-batch"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "fsdp-lab: error: --keep-global-batch: no micro-batch tried (16, 32) makes up the global "
        "batch of 8 sequences per step: 4 per data-parallel rank"
    ), line


def test_a_mixture_of_experts_gets_the_expert_parallel_degrees_it_divides():
    """8 experts on 4 CPU ranks: EP 1, 2, 4 (8 does not divide the shard axis); not with
    no_shard (EP is refused there); a dense model keeps EP 1; an override holds it; the prior
    counts EP's exchanges against the experts' smaller all-gathers."""
    moe = ["model=qwen3_moe_tiny", "hardware=cpu", "hardware.nproc_per_node=4"]
    cands, _, _ = tune.enumerate_candidates(moe, 2)
    assert {c.expert for c in cands} == {1, 2, 4}
    assert not any(c.expert > 1 and c.strategy is ShardingStrategy.no_shard for c in cands)
    ep2 = next(c for c in cands if c.expert == 2)
    assert "parallel.expert=2" in ep2.overrides()
    assert {c.expert for c in tune.enumerate_candidates(moe[1:], 2)[0]} == {1}
    held, _, _ = tune.enumerate_candidates([*moe, "parallel.expert=2"], 2)
    assert {c.expert for c in held} == {2}
    grid = tune.Grid.parse(None, None, None, None, expert="1,4")
    assert {c.expert for c in tune.enumerate_candidates(moe, 2, grid)[0]} == {1, 4}


def test_long_sequences_get_the_context_parallel_degrees_that_fit():
    """From trainer.seq_len=4096 on, CP degrees join the grid (those the ranks and the
    sequence divide); shorter ones keep CP 1 unless --context asks; an override holds it; a
    model whose attention CP does not reproduce keeps CP 1."""
    long = ["hardware=cpu", "hardware.nproc_per_node=4", "trainer.seq_len=4096"]
    long += ["model.max_position_embeddings=4096"]
    grid = tune.Grid.parse("full", "none", "1", "1")
    cands, _, _ = tune.enumerate_candidates(long, 1, grid)
    assert {c.context for c in cands} == {1, 2, 4}  # 8 does not divide 4 ranks
    by_context = {c.context: c for c in cands}
    assert "parallel.context=4" in by_context[4].overrides()
    assert (
        by_context[4].plan_peak_bytes
        < by_context[2].plan_peak_bytes
        < by_context[1].plan_peak_bytes
    )
    short = ["hardware=cpu", "hardware.nproc_per_node=4"]
    assert {c.context for c in tune.enumerate_candidates(short, 1, grid)[0]} == {1}
    asked = tune.Grid.parse("full", "none", "1", "1", context="1,2")
    assert {c.context for c in tune.enumerate_candidates(short, 1, asked)[0]} == {1, 2}
    held, _, _ = tune.enumerate_candidates([*long, "parallel.context=2"], 1, grid)
    assert {c.context for c in held} == {2}
    gpt2 = [*long, "model=gpt2_tiny"]
    assert {c.context for c in tune.enumerate_candidates(gpt2, 1, grid)[0]} == {1}


def test_pipeline_is_offered_across_nodes_and_priced_with_its_bubble():
    """Across 2 nodes PP 2 joins the grid (each stage's gathers inside its node); on one node
    only where asked, with the micro-batches its microbatches divide."""
    args = ["hardware=gpu", "hardware.nproc_per_node=8", "model.num_layers=8"]
    two, _, _ = tune.enumerate_candidates([*args, "hardware.num_nodes=2"], 8)
    one, _, _ = tune.enumerate_candidates(args, 8)
    assert {c.pipeline for c in two} == {1, 2} and {c.pipeline for c in one} == {1}
    grid = tune.Grid(pipeline=[2], strategies=[ShardingStrategy.full])
    asked, _, _ = tune.enumerate_candidates(args, 8, grid)
    assert asked and all("parallel.pipeline=2" in c.overrides() for c in asked)
    # the microbatches (one per stage) must divide the micro-batch: 1 cannot
    assert all(c.micro_batch % 2 == 0 for c in asked)
