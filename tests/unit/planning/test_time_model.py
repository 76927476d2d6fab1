"""The time model's arithmetic on hand-computed cases, the hardware profiles' file and rows,
calibrate's fits, and the plan's time lines. No ranks, and no measured benchmark row: those
are the benchmarks' (benchmarks/bench_time_model.py, benchmarks/published_runs.py)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import pytest

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.device_rows import DEVICES, device_profile, row_for
from fsdp_lab.config.hardware_profiles import (
    PROFILE_VERSION,
    SOURCE_KINDS,
    DeviceProfile,
    Link,
    Rate,
    read_profile,
    write_profile,
)
from fsdp_lab.planning import calibrate_fit, plan, plan_compare, plan_time, run_check, time_model
from fsdp_lab.planning.time_model import (
    Collective,
    PassWork,
    StepWork,
    UnitWork,
    collective_s,
    compute_s,
    predict,
)
from fsdp_lab.tools import cli

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
    return UnitWork("u", PassWork(matmul_flops=flops), PassWork(matmul_flops=2 * flops),
                    gather=gather, reduce=reduce, **kw)  # fmt: skip


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
    cpu = dataclasses.replace(ROUND, overlap=False)
    one = predict(work(unit(10e9, 40e6, 40e6)), cpu)
    two = predict(work(unit(10e9, 40e6, 40e6), micro_batches=2), cpu)
    assert two.compute_s == pytest.approx(2 * one.compute_s)
    assert two.exposed_comm_s == pytest.approx(one.exposed_comm_s + 2 * 3.03e-3)


def test_the_gradients_copies_for_their_reduction_are_made_once_a_step():
    # 100 MB copied around the reduce-scatter at 100 GB/s: 1 ms, in the last micro-batch only
    copies = PassWork(op_bytes=((20, 2, 100e6),))
    cpu = dataclasses.replace(ROUND, overlap=False)
    plain = predict(work(unit(10e9, 40e6, 40e6), micro_batches=3), cpu)
    copied = predict(work(unit(10e9, 40e6, 40e6, reduce_copies=copies), micro_batches=3), cpu)
    assert copied.compute_s - plain.compute_s == pytest.approx(1e-3)


def test_waiting_for_the_slowest_leaves_the_hidden_communication_as_it_was():
    # overlap_slowdown 0.5 of the hidden collectives; a straggle wait must not shrink them
    a, b = unit(10e9, 40e6, 40e6), unit(10e9, 40e6, 40e6, regather=False)
    slowed = dataclasses.replace(ROUND, overlap_slowdown=0.5)
    even = predict(work(a, b), slowed)
    waiting = predict(work(a, b), dataclasses.replace(slowed, straggle=0.1))
    assert waiting.compute_s == pytest.approx(even.compute_s)
    hidden = even.comm_s - even.exposed_comm_s
    assert even.compute_s == pytest.approx(60e-3 + 0.5 * hidden)


def test_ranks_wait_for_the_slowest_at_each_collective():
    # straggle 0.1: a tenth of the compute is spent waiting, only where there is a collective
    slow = dataclasses.replace(ROUND, overlap=False, straggle=0.1)
    synced = predict(work(unit(10e9, 40e6, 40e6)), slow)
    alone = predict(work(unit(10e9)), slow)
    assert synced.exposed_comm_s == pytest.approx(3 * 3.03e-3 + 0.1 * 30e-3)
    assert alone.exposed_comm_s == 0.0


def test_the_optimizer_moves_its_state_and_issues_each_tensor():
    w = dataclasses.replace(work(unit(1e9)), optimizer_params=10**8, model_flops_per_token=6e6,
                            optimizer_tensors=10)  # fmt: skip
    step = predict(w, ROUND)
    assert step.optimizer_s == pytest.approx(10**8 * 40 / 100e9)  # 40 bytes a parameter
    assert step.mfu == pytest.approx(step.tokens_per_s * 6e6 / 1e12)
    # a CPU adds the issue: 10 tensors x 60 us + a step's 1 ms to the bytes
    cpu = dataclasses.replace(ROUND, overlap=False, optimizer_step_s=1e-3)
    assert predict(w, cpu).optimizer_s == pytest.approx(10**8 * 40 / 100e9 + 10 * 60e-6 + 1e-3)


def test_a_pass_prices_each_kind_of_work_at_its_rate():
    # matmuls at a measured rate (10 us a call + FLOPs at 500 GFLOP/s), attention by the
    # nearest head size's rate at its length, other operators by their size class
    measured = dataclasses.replace(
        ROUND,
        overlap=False,
        op_overhead_s=2e-6,
        view_overhead_s=1e-6,
        matmul={"bf16 forward": Rate(500e9, 10e-6)},
        attention={"bf16 forward": [[64, 256, 100e9], [64, 1024, 200e9], [128, 1024, 400e9]]},
        memory_by_size={10: 20e9, 20: 10e9},
    )
    w = PassWork(matmul_flops=1e9, matmul_calls=4, attention_flops=1e8, head_dim=64,
                 attention_tokens=512, op_bytes=((11, 3, 6e6),), views=5)  # fmt: skip
    # 512 keys: halfway (log scale) between 256 and 1024: 150 GFLOP/s
    expect = (4 * 10e-6 + 1e9 / 500e9) + 1e8 / 150e9 + 6e6 / 20e9 + 3 * 2e-6 + 5 * 1e-6
    assert compute_s(w, measured, "bf16", time_model.FORWARD) == pytest.approx(expect)
    # beyond the lengths measured the ends hold; head size 100 is nearest 128 (log scale)
    assert measured.attention_s(4e8, "bf16", "forward", 100, 4096) == pytest.approx(1e-3)
    # a named row: the peak's fractions, and on a GPU the larger of kernels and issue
    busy = PassWork(matmul_flops=1e6, op_bytes=((10, 1000, 1e3),))
    launches = dataclasses.replace(ROUND, op_overhead_s=5e-6)
    assert compute_s(busy, launches, "bf16", "forward") == pytest.approx(1000 * 5e-6)


def test_experts_grouped_gemms_and_float8_run_at_their_own_rates():
    # 4 GFLOP forward of which 2 are experts' grouped GEMMs at 0.25 of peak: 2 ms + 8 ms
    moe = PassWork(matmul_flops=2e9, grouped_flops=2e9)
    assert compute_s(moe, dataclasses.replace(ROUND, grouped_fraction=0.25), "bf16",
                     "forward") == pytest.approx(10e-3)  # fmt: skip
    assert compute_s(moe, ROUND, "bf16", "forward") == pytest.approx(4e-3)  # as dense
    # float8 linears at the float8 rate (2 TFLOP/s), the grouped GEMMs left alone
    fp8 = dataclasses.replace(ROUND, compute={**ROUND.compute, "fp8": 2e12}, grouped_fraction=0.25)
    w = PassWork(matmul_flops=2e9, fp8_flops=2e9, grouped_flops=2e9)
    assert compute_s(w, fp8, "bf16", "forward") == pytest.approx(1e-3 + 8e-3)


def test_what_a_users_runs_taught_a_profile_scales_its_prediction():
    learned = dataclasses.replace(
        ROUND, overlap=False, learned={"compute_scale": 1.5, "comm_scale": 2.0, "host_s": 0.01}
    )
    base = predict(work(unit(1e9, 40e6, 40e6)), dataclasses.replace(ROUND, overlap=False))
    step = predict(work(unit(1e9, 40e6, 40e6)), learned)
    assert step.compute_s == pytest.approx(1.5 * base.compute_s)  # its optimizer too
    assert step.exposed_comm_s == pytest.approx(2.0 * base.exposed_comm_s)
    assert step.other_s == pytest.approx(0.01)


def test_a_profile_file_round_trips_and_another_version_is_one_line(tmp_path):
    path = tmp_path / "p.json"
    measured = dataclasses.replace(
        device_profile("cpu"),
        matmul={"fp32 forward": Rate(1e11, 3e-6)},
        attention={"fp32 forward": [[64, 256, 4e10]]},
        memory_by_size={20: 2e10},
    )
    write_profile(measured, path)
    assert read_profile(path) == measured
    assert device_profile(str(path)) == measured
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "fsdp_lab_profile": PROFILE_VERSION - 1}))
    with pytest.raises(
        ConfigError, match=f"format {PROFILE_VERSION - 1}, this fsdp_lab reads"
    ) as e:
        read_profile(path)
    assert "\n" not in str(e.value) and "calibrate again" in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable profile"):
        read_profile(path)


def test_an_unknown_device_is_one_line_naming_the_known_ones(capsys):
    with pytest.raises(ConfigError, match=r"not a known device .*h100.*calibrate wrote"):
        device_profile("h1000")
    assert cli.main(["plan", "--device", "tpu-v9"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert ", ".join(d.name for d in DEVICES) in line


def test_an_unknown_gpu_has_no_row_and_is_not_priced_as_another():
    assert row_for("gpu: 8 x NVIDIA H100 80GB HBM3") == "h100"
    assert row_for("gpu: 1 x NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert row_for("gpu: 1 x NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert row_for("gpu: 1 x NVIDIA RTX 6000 Ada Generation") is None
    assert row_for("cpu: 2 cores") == "cpu"
    base = calibrate_fit.base_profile(None, HardwareKind.gpu, "gpu: 1 x NVIDIA RTX 6000 Ada")
    assert "RTX 6000 Ada has no row" in base.sources["inter_node"]


def test_every_figure_of_a_named_row_says_where_it_comes_from():
    kinds = ("float", "int", "Link", "dict[str, float]", "float | None")
    numbers = [f.name for f in dataclasses.fields(DeviceProfile) if f.type in kinds]
    for row in DEVICES:
        for name in numbers:
            value = getattr(row, name)
            if value in (0, 0.0, None, {}) and name not in ("compute",):
                continue  # not set: nothing to source
            source = row.sources.get(name, "")
            assert source.split(":")[0] in SOURCE_KINDS, (row.name, name, source)
    for module in (time_model, plan_time):  # the work model's own constants (not imported)
        defined = set(re.findall(r"^([A-Z][A-Z0-9_]*) *=", inspect.getsource(module), re.M))
        constants = {k for k in defined if isinstance(getattr(module, k), (int, float))}
        assert constants <= set(module.SOURCES), constants - set(module.SOURCES)
        assert all(s.split(":")[0] in SOURCE_KINDS for s in module.SOURCES.values())


def test_calibrate_fits_rates_and_links_on_exact_data():
    # t = 20 us + FLOPs at 100 GFLOP/s, at four sizes
    points = [(f, 20e-6 + f / 100e9) for f in (1e5, 1e6, 1e7, 1e8)]
    rate = calibrate_fit.fit_rate(points)
    assert rate.per_s == pytest.approx(100e9, rel=1e-6)
    assert rate.latency_s == pytest.approx(20e-6, rel=1e-6)
    # 4 ranks, 20 us a step, 5 GB/s: t = 3 x 20 us + 3/4 S / 5 GB/s
    times = {s: 3 * 20e-6 + 0.75 * s / 5e9 for s in (2**16, 2**20, 2**24)}
    link = calibrate_fit.fit_link(times, "all_gather", 4)
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert link.bytes_per_s == pytest.approx(5e9, rel=1e-6)


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


def test_a_plan_without_a_measured_machine_says_so(tmp_path):
    built = plan.build_plan(["hardware=cpu", f"hardware.profile_cache={tmp_path}"])
    assert any(a.startswith("unmeasured: step times are priced on") for a in built.assumptions)
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


def test_checkpointing_recomputes_a_units_forward_and_float8_shortens_the_step():
    pytest.importorskip("torchao")
    h100_1b = ["experiment=gpu_1b", "hardware.nproc_per_node=1", "trainer.micro_batch_size=8"]
    bf16 = plan.build_plan(h100_1b, "h100").chosen_plan.time
    full = plan.build_plan([*h100_1b, "activation_checkpointing=full"], "h100").chosen_plan.time
    assert 1.2 * bf16.compute_s < full.compute_s < 1.45 * bf16.compute_s  # ~one more forward
    f8 = plan.build_plan([*h100_1b, "precision.float8_recipe=tensorwise"], "h100").chosen_plan.time
    assert f8.compute_s < bf16.compute_s  # by how much: the GPU benchmark measures it


def test_eager_experts_are_dense_matmuls_and_grouped_ones_run_at_the_grouped_rate():
    moe = ["model=qwen3_moe_tiny", "trainer.seq_len=64", "trainer.micro_batch_size=2"]
    big = [*moe, "hardware=gpu", "model.hidden_size=1024", "model.expert_intermediate_size=512"]
    big += ["model.num_experts=64", "model.experts_per_token=8", "trainer.micro_batch_size=64"]
    grouped_s = plan.build_plan(big, "h100").chosen_plan.time.compute_s
    eager = [*big, "model.experts_implementation=eager"]
    assert plan.build_plan(eager, "h100").chosen_plan.time.compute_s < grouped_s


def test_a_masked_lm_attends_every_key_a_causal_lm_half():
    from fsdp_lab.config import HardwareKind, compose

    layer = dataclasses.make_dataclass("Layer", ["q_dim", "sliding_window"])(
        q_dim=64, sliding_window=None
    )
    flops = {
        name: plan_time._attention_flops(
            compose([f"model={name}", "trainer.seq_len=128", "trainer.micro_batch_size=2"]),
            layer,
            HardwareKind.cpu,
        )
        for name in ("bert_tiny", "llama_tiny")
    }
    assert flops["llama_tiny"] == 4 * 2 * 128 * 64 * 64  # QK^T and AV over half the keys
    assert flops["bert_tiny"] == 2 * flops["llama_tiny"]


def test_tp_dispatch_is_priced_for_the_linears_tp_splits():
    from collections import Counter

    from fsdp_lab.config import HardwareKind, compose

    cfg = compose(["model=llama_tiny", "parallel.tensor=2", "hardware.nproc_per_node=4"])
    shape = plan.inspect_model(cfg, HardwareKind.cpu)
    # q, k, v, o, gate, up, down in each block; no norm, embedding or head
    assert Counter(p.group for p in shape.params if p.tp_linear) == {0: 7, 1: 7}
