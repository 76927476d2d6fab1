"""profile=trace's analysis on hand-made traces whose overlaps are known: the interval
arithmetic, the cpu (gloo) reader and the gpu (NCCL) reader, down to the microsecond."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from fsdp_lab.config import ConfigError
from fsdp_lab.observe.profile.analysis import analyse, analyse_dir, analyse_trace
from fsdp_lab.observe.profile.intervals import clip, intersect, length, subtract, union
from fsdp_lab.observe.profile.result import ProfileResult, summary_dict
from fsdp_lab.observe.profile.summary import summary_line, table
from fsdp_lab.observe.profile.timeline import (
    KERNEL_KIND_NAMES,
    build_timeline,
    collective_kind,
    kernel_kind,
    load_trace,
)

MAIN, GLOO, STREAM7, STREAM21 = 100, 101, 7, 21


def op(name, ts, dur, *, tid=MAIN, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}


def note(name, ts, dur, tid=MAIN):
    return op(name, ts, dur, tid=tid, cat="user_annotation")


def trace(events, rank=0):
    return {"traceEvents": events, "distributedInfo": {"rank": rank, "backend": "gloo"}}


# --- intervals --------------------------------------------------------------------------------


def test_union_merges_nested_overlapping_and_touching_intervals():
    assert union([(5, 9), (0, 10), (10, 12), (20, 30), (25, 26), (40, 40)]) == [(0, 12), (20, 30)]
    assert length(union([(0, 10), (2, 3), (5, 15)])) == 15  # durations would sum to 21


def test_exposed_is_comm_minus_its_overlap_with_compute_exactly():
    rng = random.Random(0)
    for _ in range(500):
        compute = union(
            (s, s + rng.uniform(0, 20)) for s in (rng.uniform(0, 100) for _ in range(6))
        )
        comm = union((s, s + rng.uniform(0, 20)) for s in (rng.uniform(0, 100) for _ in range(6)))
        exposed = subtract(comm, compute)
        assert length(exposed) == pytest.approx(length(comm) - length(intersect(comm, compute)))
        assert length(union(compute + comm)) == pytest.approx(length(compute) + length(exposed))
        assert all(c[0] <= e[0] and e[1] <= c[1] for e in exposed for c in [_cover(comm, e)])


def _cover(intervals, inner):
    return next(i for i in intervals if i[0] <= inner[0] and inner[1] <= i[1])


def test_a_collective_split_by_compute_leaves_its_two_ends_exposed():
    assert subtract([(0, 100)], [(20, 30), (50, 60)]) == [(0, 20), (30, 50), (60, 100)]
    assert subtract([(0, 100)], [(-5, 200)]) == []
    assert clip([(0, 10), (20, 30)], 5, 25) == [(5, 10), (20, 25)]
    assert clip([], 0, 10) == [] and subtract([], [(0, 1)]) == [] and intersect([(0, 1)], []) == []


# --- the cpu reader ---------------------------------------------------------------------------


def cpu_step(step, t0):
    """One step at t0 (us): forward compute 0-100; an all-gather of model.layers.0 issued at
    110, run by gloo 115-145 while the main thread waits; compute 150-250 under an autograd
    node that also encloses a reduce-scatter of the root (issued 260, gloo 262-290, compute
    from 280 overlapping it); the optimizer 296-298 and the data region 300-340 with no compute
    in them; the step ends at 350."""
    t = t0
    return [
        note(f"fsdp_lab::step {step}", t, 350),
        op("aten::mm", t, 100),
        op("aten::addmm", t + 20, 30),  # nested: not counted twice
        note("FSDP::all_gather (model.layers.0)", t + 105, 45),
        op("fsdp::all_gather_copy_in", t + 106, 3),
        op("c10d::_allgather_base_", t + 110, 2),
        op("gloo:all_gather", t + 115, 30, tid=GLOO, cat="user_annotation"),
        op("autograd::engine::evaluate_function: X", t + 150, 145),  # encloses a wait
        op("aten::mul", t + 150, 100),
        note("FSDP::post_backward_reduce", t + 255, 30),
        op("c10d::_reduce_scatter_base_", t + 260, 1),
        op("gloo:all_reduce", t + 262, 28, tid=GLOO, cat="user_annotation"),
        op("aten::add", t + 280, 15),
        note("Optimizer.step#AdamW.step", t + 296, 2),
        note("fsdp_lab::data", t + 300, 40),
    ]


def test_the_cpu_reader_splits_a_step_into_compute_exposed_comm_and_idle():
    tl = build_timeline(trace(cpu_step(5, 1000) + cpu_step(6, 2000), rank=1))
    assert tl.device == "cpu" and tl.rank == 1
    assert [s[0] for s in tl.steps] == [5, 6]
    profile = analyse(tl, rank=1, trace="t.json")
    s = profile.steps[0]
    us = 1e-6
    assert s.step_s == pytest.approx(350 * us)
    # compute: 0-100, 106-109, 150-250, 280-295 (the autograd node that waits is not compute)
    assert s.compute_s == pytest.approx((100 + 3 + 100 + 15) * us)
    assert s.comm_s == pytest.approx((30 + 28) * us)
    assert s.exposed_comm_s == pytest.approx((30 + 18) * us)  # 280-290 of the 262-290 hidden
    assert s.idle_s == pytest.approx(s.step_s - s.compute_s - s.exposed_comm_s)
    assert s.idle_data_s == pytest.approx(40 * us)
    assert s.idle_optimizer_s == pytest.approx(2 * us)
    assert s.idle_host_s == pytest.approx(s.idle_s - 42 * us)
    units = {(u.unit, u.kind): u for u in s.units}
    assert set(units) == {("model.layers.0", "all_gather"), ("root", "reduce_scatter")}
    assert units["root", "reduce_scatter"].exposed_s == pytest.approx(18 * us)
    assert units["model.layers.0", "all_gather"].count == 1


def test_a_gloo_collective_without_its_call_in_the_window_is_outside_fsdp():
    events = [note("fsdp_lab::step 1", 0, 100), op("gloo:all_reduce", 10, 5, tid=GLOO)]
    (s,) = analyse(build_timeline(trace(events)), rank=0, trace="t").steps
    assert [(u.unit, u.kind) for u in s.units] == [("other", "all_reduce")]
    assert s.exposed_comm_s == pytest.approx(5e-6)


def test_an_empty_window_has_no_steps_and_no_picture():
    profile = analyse(build_timeline(trace([op("aten::mm", 0, 5)])), rank=0, trace="t")
    assert profile.steps == [] and profile.picture is None
    result = ProfileResult([profile])
    assert result.mean().step_s == 0 and "no collective" in table(result)


# --- the gpu reader ---------------------------------------------------------------------------


def launch(ts, corr, tid=MAIN):
    return op("cudaLaunchKernel", ts, 2, tid=tid, cat="cuda_runtime", correlation=corr)


def kernel(name, ts, dur, corr, stream):
    return op(name, ts, dur, tid=stream, cat="kernel", correlation=corr)


def test_the_gpu_reader_classifies_kernels_by_name_across_streams_and_launches():
    """The host runs ahead: step 1's kernels run 100-400, step 2's from 400. The NCCL all-gather
    (stream 21) of model.layers.3 overlaps two compute kernels on stream 7 and is exposed only
    where neither runs; a memcpy counts as compute."""
    events = [
        note("fsdp_lab::step 1", 0, 80),
        note("FSDP::all_gather (model.layers.3)", 10, 10),
        launch(12, 1),
        launch(30, 2),
        launch(40, 3),
        launch(50, 4),
        note("fsdp_lab::step 2", 80, 80),
        launch(90, 5),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgs)", 150, 100, 1, STREAM21),
        kernel("ampere_bf16_gemm", 100, 80, 2, STREAM7),
        kernel("void at::native::elementwise_kernel", 200, 20, 3, STREAM7),
        op(
            "Memcpy HtoD (Pageable -> Device)",
            300,
            50,
            tid=STREAM7,
            cat="gpu_memcpy",
            correlation=4,
        ),
        kernel("ampere_bf16_gemm", 400, 60, 5, STREAM7),
        # Kineto's copy of a step annotation on the GPU's timeline: not a step of its own.
        op("fsdp_lab::step 1", 100, 300, tid=STREAM7, cat="gpu_user_annotation"),
    ]
    tl = build_timeline(trace(events))
    assert tl.device == "gpu"
    assert tl.steps == [(1, 100.0, 400.0), (2, 400.0, 460.0)]
    s1, s2 = analyse(tl, rank=0, trace="t").steps
    us = 1e-6
    assert s1.step_s == pytest.approx(300 * us)
    assert s1.compute_s == pytest.approx((80 + 20 + 50) * us)
    assert s1.comm_s == pytest.approx(100 * us)
    assert s1.exposed_comm_s == pytest.approx((200 - 180 + 250 - 220) * us)
    assert s1.idle_s == pytest.approx(300 * us - (150 + 50) * us)
    ((unit,),) = [s1.units]
    assert (unit.unit, unit.kind, unit.exposed_s) == (
        "model.layers.3",
        "all_gather",
        s1.exposed_comm_s,
    )
    assert s2.step_s == pytest.approx(60 * us) and s2.comm_s == 0 and s2.units == []


# --- files ------------------------------------------------------------------------------------


def test_traces_are_read_again_from_a_dir_as_gz_or_json(tmp_path):
    events = cpu_step(3, 0)
    with gzip.open(tmp_path / "rank0.trace.json.gz", "wt") as f:
        json.dump(trace(events, rank=0), f)
    (tmp_path / "rank1.trace.json").write_text(json.dumps({"traceEvents": events}))
    result = analyse_dir(tmp_path, relative_to=tmp_path)
    assert [r.rank for r in result.ranks] == [0, 1]  # rank 1 from its file's name
    assert result.ranks[0].trace == "rank0.trace.json.gz"
    again = ProfileResult.from_dict(json.loads(json.dumps(result.as_dict())))
    assert again.mean() == result.mean()


def test_a_cut_or_foreign_trace_is_one_line_naming_the_file(tmp_path):
    cut = tmp_path / "rank0.trace.json.gz"
    cut.write_bytes(gzip.compress(b'{"traceEvents": [')[:-4])
    with pytest.raises(ConfigError, match=r"cannot read the trace .*rank0"):
        load_trace(cut)
    other = tmp_path / "x.json"
    other.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"not a torch\.profiler trace"):
        load_trace(other)
    with pytest.raises(ConfigError, match="no rank"):
        analyse_dir(tmp_path / "empty")


def test_a_reduce_scatter_launched_from_autograds_thread_keeps_its_unit_and_kind():
    """Backward runs on autograd's device thread; NCCL may name the kernel generically: the
    unit comes from that thread's FSDP annotation, the kind from the c10d call around the
    launch."""
    autograd = 555
    events = [
        note("fsdp_lab::step 3", 0, 100),
        note("FSDP::post_backward_reduce (model.layers.1)", 10, 30, tid=autograd),
        op("c10d::_reduce_scatter_base_", 15, 10, tid=autograd),
        launch(16, 9, tid=autograd),
        launch(50, 10),
        kernel("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", 200, 40, 9, STREAM21),
        kernel("gemm", 150, 30, 10, STREAM7),
    ]
    (s,) = analyse(build_timeline(trace(events)), rank=0, trace="t").steps
    ((unit,),) = [s.units]
    assert (unit.unit, unit.kind, unit.count) == ("model.layers.1", "reduce_scatter", 1)
    assert s.exposed_comm_s == pytest.approx(40e-6) and s.step_s == pytest.approx(90e-6)


def test_context_parallel_collectives_are_a_kind_of_their_own_on_cpu_and_gpu():
    """The CP attention's all-gather and its backward's reduce-scatter run inside annotations
    of their own: reported apart from FSDP's gathers and reductions, by either reader."""
    gather, scatter = "fsdp_lab::context_all_gather", "fsdp_lab::context_reduce_scatter"
    cpu = [
        note("fsdp_lab::step 1", 0, 200),
        note("FSDP::all_gather (model.layers.0)", 5, 20),
        op("c10d::_allgather_base_", 10, 10),
        op("gloo:all_gather", 12, 8, tid=GLOO),
        note(gather, 40, 20),
        op("c10d::_allgather_base_", 42, 15),
        op("gloo:all_gather", 45, 10, tid=GLOO),
        note(scatter, 100, 20),
        op("c10d::_reduce_scatter_base_", 102, 15),
        op("gloo:all_reduce", 104, 12, tid=GLOO),
    ]
    (s,) = analyse(build_timeline(trace(cpu)), rank=0, trace="t").steps
    assert [(u.unit, u.kind) for u in s.units] == [
        ("model.layers.0", "all_gather"),
        ("other", "context_all_gather"),
        ("other", "context_reduce_scatter"),
    ]
    gpu = [
        note("fsdp_lab::step 1", 0, 100),
        note(gather, 10, 20),
        op("c10d::_allgather_base_", 12, 10),
        launch(14, 3),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 9, 3, 21),
        launch(40, 4),
        kernel("gemm", 60, 30, 4, STREAM7),
    ]
    (s,) = analyse(build_timeline(trace(gpu)), rank=0, trace="t").steps
    assert [(u.unit, u.kind) for u in s.units] == [("other", "context_all_gather")]


def test_a_pipeline_receive_on_the_main_thread_is_its_wait_for_the_stage_before():
    """gloo runs a pipeline's send and receive on the calling thread: a receive's span is the
    wait for the previous stage (the bubble), counted as pipeline_p2p, not compute."""
    events = [
        note("fsdp_lab::step 1", 0, 100),
        op("aten::mm", 0, 20),
        op("c10d::recv_", 20, 2),
        op("gloo:recv", 22, 40, cat="user_annotation"),
        op("aten::mm", 62, 30),
    ]
    (s,) = analyse(build_timeline(trace(events)), rank=0, trace="t").steps
    assert [(u.kind, u.time_s) for u in s.units] == [("pipeline_p2p", 40 * 1e-6)]
    assert s.compute_s == pytest.approx(50 * 1e-6)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("c10d::_allgather_base_", "all_gather"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
        ("gloo:all_reduce", "all_reduce"),
        ("gloo:all_to_all", "all_to_all"),  # expert parallelism's exchange
        ("c10d::alltoall_base_", "all_to_all"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "other"),
        ("c10d::send", "pipeline_p2p"),  # a pipeline's stages
        ("c10d::recv_", "pipeline_p2p"),
        ("gloo:recv", "pipeline_p2p"),
    ],
)
def test_collectives_are_named_by_kind(name, kind):
    assert collective_kind(name) == kind


# --- a real GPU trace -------------------------------------------------------------------------

# experiment=gpu_1b profile=trace on one H100 80GB (torch 2.11.0+cu130, 2026-11-26), steps 5-7,
# trimmed to what the reader reads (host operators, flow events and args dropped: 300 KB).
# benchmarks/bench_gpu.py measured the same recipe at 248.3 ms a step in the same session.
H100_TRACE = Path(__file__).parent / "data" / "h100_1b.trace.json.gz"


def test_a_real_h100_trace_splits_each_step_and_says_what_its_kernels_were():
    rank = analyse_trace(H100_TRACE)
    result = ProfileResult(ranks=[rank])
    assert rank.device == "gpu" and [s.step for s in rank.steps] == [5, 6, 7]
    times = [s.step_s for s in rank.steps]
    # The window opens while step 4's tail (its backward's end, its optimizer step) still runs
    # on the device: launched before the profiler recorded, it is no step's. Counted in step 5,
    # it made that step 315 ms against 246 and 250.
    assert max(times) / min(times) < 1.06, times
    assert all(0.235 < t < 0.265 for t in times), times
    for s in rank.steps:
        assert s.comm_s == 0 and s.units == []  # one rank: no NCCL kernel
        assert s.compute_s / s.step_s > 0.95
        assert s.step_s == pytest.approx(s.compute_s + s.exposed_comm_s + s.idle_s)
        # Kernels of two kinds never run at once here (one stream): the kinds add up to compute.
        assert sum(s.kernels.values()) == pytest.approx(s.compute_s, rel=1e-3)
        assert list(s.kernels) == [k for k in KERNEL_KIND_NAMES if k in s.kernels]
        ranked = sorted(s.kernels, key=lambda k: -s.kernels[k])
        assert ranked[:3] == ["matmul", "attention", "fused"], s.kernels
        assert s.kernels["matmul"] / s.compute_s > 0.5
        assert s.kernels["optimizer"] > 0.01 and s.kernels["copy"] > 0.005
        assert s.kernels.get("other", 0) / s.compute_s < 0.03
    summary = summary_dict(result.mean())
    assert summary["kernel_matmul_share"] == pytest.approx(0.59, abs=0.02)
    assert "compute: matmul 59%, attention 16%, fused 11%, optimizer 7%" in summary_line(result)
    text = table(result)
    assert "compute by kernel kind" in text and "144.2 (59%)" in text
    # Back from run.json, the kinds survive.
    again = ProfileResult.from_dict(json.loads(json.dumps(result.as_dict())))
    assert again.mean().kernels == pytest.approx(result.mean().kernels)


@pytest.mark.parametrize(
    "name,cat,kind",
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "kernel", "matmul"),
        (
            "void cublasLt::splitKreduce_kernel<32, 16, int, float>",
            "kernel",
            "matmul",
        ),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", "matmul"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma",
            "kernel",
            "attention",
        ),
        (
            "void cudnn::fusion::compute_dot_do_o_specialized<true>",
            "kernel",
            "attention",
        ),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "kernel", "attention"),
        ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0", "kernel", "fused"),
        ("triton_red_fused__log_softmax__to_copy_exp_ne_neg_prepare_softmax", "kernel", "fused"),
        (
            "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "kernel",
            "optimizer",
        ),
        ("void at::native::cunn_SoftMaxForward<4, float, float, float>", "kernel", "loss"),
        (
            "void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float>",
            "kernel",
            "loss",
        ),
        (
            "void at::native::vectorized_elementwise_kernel<8, bfloat16_copy_kernel_cuda>",
            "kernel",
            "copy",
        ),
        ("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>", "kernel", "copy"),
        ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "copy"),
        ("Memset (Device)", "gpu_memset", "copy"),
        ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>", "kernel", "other"),
    ],
)
def test_kernels_are_named_by_kind(name, cat, kind):
    assert kernel_kind(name, cat) == kind
