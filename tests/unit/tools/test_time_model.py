"""The time model's arithmetic on hand-computed cases, the hardware profiles' file, calibrate's
fits and its refusal of a noisy machine, and the plan's time lines. No ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fsdp_lab.config import ConfigError
from fsdp_lab.config.hardware_profiles import (
    PROFILE_VERSION,
    DeviceProfile,
    Link,
    device_profile,
    read_profile,
    write_profile,
)
from fsdp_lab.tools import calibrate, cli, plan, plan_compare, run_check
from fsdp_lab.tools.time_model import Collective, StepWork, UnitWork, collective_s, predict

# A device of round numbers: 1 TFLOP/s, 100 GB/s memory, links of 10 GB/s and 10 us a step.
ROUND = DeviceProfile(
    name="round",
    kind="gpu",
    compute={"bf16": 1e12, "fp32": 1e12},
    matmul_fraction=1.0,
    memory_bytes_per_s=100e9,
    intra_node=Link(10e9, 10e-6),
    inter_node=Link(1e9, 100e-6),
    host_link=Link(10e9, 0.0),
    host_memory_bytes_per_s=10e9,
    op_overhead_s=0.0,
    overlap=True,
)


def unit(flops: float, gather_bytes: float = 0.0, reduce_bytes: float = 0.0, **kw) -> UnitWork:
    """A unit whose backward is twice its forward, on 4 ranks within a node."""
    gather = Collective("all_gather", gather_bytes, 4) if gather_bytes else None
    reduce = (Collective("reduce_scatter", reduce_bytes, 4),) if reduce_bytes else ()
    return UnitWork("u", flops, 2 * flops, 0.0, 0.0, 0, 0, gather=gather, reduce=reduce, **kw)


def work(*units: UnitWork, micro_batches: int = 1) -> StepWork:
    return StepWork(units=units, micro_batches=micro_batches, tokens=1000, dtype="bf16",
                    optimizer_params=0)  # fmt: skip


def test_a_ring_collective_costs_its_steps_latency_and_its_share_of_the_bytes():
    # 4 ranks, 40 MB: 3 steps x 10 us + 3/4 x 40 MB / 10 GB/s = 30 us + 3 ms
    assert collective_s(Collective("all_gather", 40e6, 4), ROUND) == pytest.approx(3.03e-3)
    assert collective_s(Collective("reduce_scatter", 40e6, 4), ROUND) == pytest.approx(3.03e-3)
    assert collective_s(Collective("all_reduce", 40e6, 4), ROUND) == pytest.approx(6.06e-3)
    across = Collective("all_gather", 40e6, 4, across_nodes=True, count=2)
    assert collective_s(across, ROUND) == pytest.approx(2 * (300e-6 + 30e-3))
    assert collective_s(Collective("all_gather", 40e6, 1), ROUND) == 0.0  # one rank: a copy


def test_one_unit_its_gather_and_reduce_exposed_whole():
    # 1 GFLOP forward (1 ms), 2 backward (2 ms); a gather of 3.03 ms each way, reduce 3.03 ms:
    # nothing to hide under, so the first gather (forward), the backward's first gather and
    # the last reduce-scatter are exposed whole.
    step = predict(work(unit(1e9, 40e6, 40e6)), ROUND)
    assert step.compute_s == pytest.approx(3e-3)
    assert step.exposed_comm_s == pytest.approx(3 * 3.03e-3)
    assert step.step_s == pytest.approx(3e-3 + 3 * 3.03e-3)
    assert step.tokens_per_s == pytest.approx(1000 / step.step_s)
    assert step.compute_s + step.exposed_comm_s + step.optimizer_s + step.other_s == step.step_s


def test_prefetch_hides_the_next_gather_under_this_units_compute():
    # Two units of 10 GFLOP (10 ms forward, 20 ms backward), gathers of 3.03 ms: in forward
    # only the first is exposed; in backward the first (unit 2's, not resharded: regather
    # False here) and the last reduce-scatter (unit 1's); the rest hides.
    a = unit(10e9, 40e6, 40e6)
    b = unit(10e9, 40e6, 40e6, regather=False)
    step = predict(work(a, b), ROUND)
    assert step.compute_s == pytest.approx(60e-3)
    assert step.exposed_comm_s == pytest.approx(3.03e-3 + 3.03e-3)
    # A unit too short to hide the next gather exposes the difference: 1 ms of compute under
    # a 3.03 ms gather leaves 2.03 ms
    short = unit(1e9, 40e6, 0.0)
    step = predict(work(short, unit(1e9, 40e6, 0.0, regather=False)), ROUND)
    # ... and in backward 3.03 ms under unit 2's 2 ms: 1.03 ms
    assert step.exposed_comm_s == pytest.approx(3.03e-3 + 2.03e-3 + 1.03e-3)
    # Without overlap (a CPU: gloo waits) every collective is exposed
    cpu = dataclasses.replace(ROUND, overlap=False)
    step = predict(work(a, b), cpu)
    assert step.exposed_comm_s == pytest.approx(3.03e-3 * 5)  # 2 + 1 gathers, 2 reduces


def test_accumulation_gathers_every_micro_batch_and_reduces_once():
    one = predict(work(unit(10e9, 40e6, 40e6)), dataclasses.replace(ROUND, overlap=False))
    two = predict(
        work(unit(10e9, 40e6, 40e6), micro_batches=2), dataclasses.replace(ROUND, overlap=False)
    )
    assert two.compute_s == pytest.approx(2 * one.compute_s)
    assert two.exposed_comm_s == pytest.approx(one.exposed_comm_s + 2 * 3.03e-3)


def test_the_optimizer_moves_its_state_at_the_memory_bandwidth_and_mfu_uses_the_peak():
    w = dataclasses.replace(work(unit(1e9)), optimizer_params=10**8, model_flops_per_token=6e6)
    step = predict(w, ROUND)
    assert step.optimizer_s == pytest.approx(10**8 * 40 / 100e9)  # 40 bytes a parameter
    assert step.mfu == pytest.approx(step.tokens_per_s * 6e6 / 1e12)


def test_experts_grouped_gemms_run_at_their_own_rate():
    # 4 GFLOP forward of which 2 are experts' grouped GEMMs at 0.25 of peak: 2 ms + 8 ms;
    # backward twice each: 4 ms + 16 ms. A profile without the fraction runs them as dense.
    moe = unit(4e9, forward_grouped=2e9, backward_grouped=4e9)
    step = predict(work(moe), dataclasses.replace(ROUND, grouped_fraction=0.25))
    assert step.compute_s == pytest.approx(30e-3)
    assert predict(work(moe), ROUND).compute_s == pytest.approx(12e-3)
    # float8 converts linears, not the experts: its share leaves their GEMMs alone
    fp8 = dataclasses.replace(ROUND, compute={**ROUND.compute, "fp8": 2e12}, grouped_fraction=0.25)
    step = predict(work(unit(4e9, forward_grouped=2e9, backward_grouped=4e9, fp8_share=1.0)), fp8)
    assert step.compute_s == pytest.approx(3e-3 + 24e-3)


def test_a_profile_file_round_trips_and_another_version_is_one_line(tmp_path):
    path = tmp_path / "p.json"
    write_profile(device_profile("h100"), path)
    assert read_profile(path) == device_profile("h100")
    assert device_profile(str(path)) == device_profile("h100")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "fsdp_lab_profile": PROFILE_VERSION + 1}))
    with pytest.raises(ConfigError, match="format 2, this fsdp_lab reads 1") as e:
        read_profile(path)
    assert "\n" not in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable profile"):
        read_profile(path)


def test_an_unknown_device_is_one_line_naming_the_known_ones(capsys):
    with pytest.raises(ConfigError, match=r"not a known device .*h100.*calibrate wrote"):
        device_profile("h1000")
    assert cli.main(["plan", "--device", "tpu-v9"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "a100-40gb, a100-80gb, h100, h200, b200, cpu" in line


def test_calibrate_fits_latency_and_bandwidth_and_refuses_a_noisy_machine():
    # 4 ranks, 20 us a step, 5 GB/s: t = 3 x 20 us + 3/4 S / 5 GB/s
    times = {s: [3 * 20e-6 + 0.75 * s / 5e9] * 3 for s in (2**16, 2**20, 2**24)}
    link = calibrate.fit_link(times, "all_gather", 4)
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert link.bytes_per_s == pytest.approx(5e9, rel=1e-6)
    quiet = {"matmul": [1.0, 1.02, 0.99, 1.01, 5.0]}  # one outlier is dropped
    calibrate.check_spread(quiet, 0.25)
    noisy = {"matmul": [1.0, 1.02], "all_gather 16.0 MiB": [1.0, 1.7, 1.0, 0.5, 1.6]}
    with pytest.raises(ConfigError, match=r"too noisy to trust: all_gather 16\.0 MiB varied 60%"):
        calibrate.check_spread(noisy, 0.25)


def test_the_plan_prints_the_step_beside_the_memory_on_the_device_named(capsys):
    args = ["plan", "--device", "h100", "--nodes", "2", "--json"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world_size"], out["time_device"]) == (16, "h100")
    full = out["strategies"]["full"]["time"]
    assert full["step_s"] > 0 and full["mfu"] > 0
    assert sum(full[k] for k in ("compute_s", "exposed_comm_s", "optimizer_s", "other_s")) == (
        pytest.approx(full["step_s"])
    )
    # across 2 nodes full shards over the network, hybrid's gathers stay within a node
    hybrid = out["strategies"]["hybrid"]["time"]
    assert hybrid["exposed_comm_s"] <= full["exposed_comm_s"]


def test_compare_gives_one_row_per_combination_and_marks_the_fastest():
    overrides = plan_compare.with_device(["trainer.seq_len=128"], "h100", 1)
    assert overrides[:2] == ["hardware=gpu", "hardware.nproc_per_node=8"]
    rows, device = plan_compare.compare(
        overrides, ["sharding=full,grad_op", "activation_checkpointing=none,full"], "h100"
    )
    assert device == "h100" and len(rows) == 4
    by = {tuple(r.settings): r for r in rows}
    ac = by["sharding=full", "activation_checkpointing=full"]
    no_ac = by["sharding=full", "activation_checkpointing=none"]
    assert ac.time.compute_s > no_ac.time.compute_s and ac.peak < no_ac.peak  # recompute
    table = plan_compare.format_compare(rows, device)
    assert table.count("\n* ") == 1
    with pytest.raises(ConfigError, match="--compare sharding: give KEY=V1,V2"):
        plan_compare.compare(overrides, ["sharding"], "h100")


def test_a_calibrated_profile_measured_on_other_ranks_is_named_in_the_plan(tmp_path):
    p = dataclasses.replace(device_profile("cpu"), measured={"ranks": 4})
    write_profile(p, tmp_path / "cpu4.json")
    built = plan.build_plan(["hardware=cpu"], str(tmp_path / "cpu4.json"))
    assert any("measured with 4 ranks per node, the plan has 2" in a for a in built.assumptions)


def test_a_run_departs_where_its_measured_split_is_furthest_from_the_prediction():
    predicted = {"compute_s": 1.0, "exposed_comm_s": 0.1}
    assert run_check.departure(1.05, predicted, None) == "as predicted"
    assert "1.60x the prediction; profile=trace splits" in run_check.departure(1.6, predicted, None)
    network = {"step_s": 1.5, "compute_s": 1.0, "exposed_comm_s": 0.45, "idle_s": 0.05}
    assert run_check.departure(1.4, predicted, network) == (
        "exposed communication 4.50x the prediction: the network or the overlap"
    )
    host = {"step_s": 2.0, "compute_s": 1.0, "exposed_comm_s": 0.1, "idle_s": 0.9}
    assert run_check.departure(1.8, predicted, host).startswith("idle 45% of the step")


def test_a_run_is_priced_on_its_profile_or_the_gpu_it_ran_on():
    cfg = plan.compose(["hardware.profile=b200"])
    assert run_check.device_name(cfg, "gpu: 8 x NVIDIA H100 80GB HBM3") == "b200"
    cfg = plan.compose([])
    assert run_check.device_name(cfg, "gpu: 8 x NVIDIA H100 80GB HBM3") == "h100"
    assert run_check.device_name(cfg, "gpu: 1 x NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert run_check.device_name(cfg, "gpu: 1 x NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert run_check.device_name(cfg, "cpu: 2 cores") == "cpu"


H100_1B = ["experiment=gpu_1b", "hardware.nproc_per_node=1", "trainer.micro_batch_size=8"]


@pytest.mark.parametrize(
    "overrides,measured_s",
    [  # benchmarks/results/h100-2026-11-26-{1b,160m}.json: one H100 80GB, compiled, bf16
        (H100_1B, 0.24827),
        (["experiment=gpu_160m", "hardware.nproc_per_node=1"], 0.074058),
    ],
)
def test_the_measured_h100_steps_are_predicted_from_the_h100_row_alone(overrides, measured_s):
    step = plan.build_plan(overrides, "h100").chosen_plan.time
    assert abs(step.step_s / measured_s - 1) < 0.15
    assert step.exposed_comm_s == 0.0  # one rank: nothing to gather


def test_float8_linears_shorten_a_1b_models_predicted_step():
    pytest.importorskip("torchao")
    bf16 = plan.build_plan(H100_1B, "h100").chosen_plan.time
    f8 = plan.build_plan([*H100_1B, "precision.float8_recipe=tensorwise"], "h100").chosen_plan.time
    assert f8.compute_s < 0.8 * bf16.compute_s


def test_calibrate_measures_a_mixture_of_experts_grouped_gemms_at_its_shapes():
    moe = ["model=qwen3_moe_tiny", "trainer.seq_len=64", "trainer.micro_batch_size=2"]
    *_, grouped = calibrate.shapes_and_sizes(moe)
    # 8 experts, top 2: 128 tokens' 256 copies, 32 an expert; gate+up 64 -> 128, down 64 -> 64
    assert grouped == [(8, 32, 64, 128), (8, 32, 64, 64)]
    assert calibrate.shapes_and_sizes(["trainer.seq_len=64"])[-1] == []
    # the plan prices those experts at the grouped rate, eager ones as dense matmuls
    big = [*moe, "hardware=gpu", "model.hidden_size=1024", "model.expert_intermediate_size=512"]
    big += ["model.num_experts=64", "model.experts_per_token=8", "trainer.micro_batch_size=64"]
    grouped_s = plan.build_plan(big, "h100").chosen_plan.time.compute_s
    eager = [*big, "model.experts_implementation=eager"]
    assert plan.build_plan(eager, "h100").chosen_plan.time.compute_s < grouped_s
