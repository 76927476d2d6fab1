"""The named devices, one row each (``DeviceProfile``), with where every figure of a row
comes from (``DeviceProfile.sources``; docs/benchmarks.md, "Hardware profiles", tabulates
them), and how a device is looked up: by name, by the hardware a run describes, or as a
profile file ``fsdp-lab calibrate`` wrote. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_lab.config.errors import ConfigError
from fsdp_lab.config.hardware_profiles import (
    GB,
    DeviceProfile,
    Link,
    peak_tflops,
    read_profile,
)

# Where each figure of the GPU rows comes from (docs/benchmarks.md, "Hardware profiles", has
# the tables these name). Keyed by DeviceProfile field; a row adds its own for its numbers.
_GPU_SOURCES = {
    "compute": "datasheet: NVIDIA's dense (no sparsity) peaks, as tabulated in "
    "stas00/ml-engineering compute/accelerator/README.md and torchtitan's get_peak_flops",
    "matmul_fraction": "micro-benchmark: the maximum achievable matmul FLOP/s (MAMF) over the "
    "peak, ml-engineering's mamf-finder tables (bf16, best shape)",
    "fp8_fraction": "micro-benchmark: ml-engineering's mamf-finder tables, fp8",
    "shape_fraction": "micro-benchmark: the matmul kernels of a 1.1B Llama's compiled training "
    "step on one H100 (8 x 2048 tokens) ran at 0.888 of its MAMF: 144.2 ms for 1.017e14 "
    "FLOPs in its profile (benchmarks/results/h100-2026-11-26-checks.json)",
    "memory_bytes_per_s": "datasheet: NVIDIA's HBM bandwidth",
    "memory_bytes": "datasheet: NVIDIA's HBM capacity",
    "intra_node": "micro-benchmark: nccl-tests' ring bus bandwidth on one 8-GPU node "
    "(8 x H200: all-gather 361.4, reduce-scatter 362.9 GB/s; 8 x A100 ~235; 8 x B200 ring "
    "all-reduce 682; stas00/ml-engineering network/README.md); latency per ring step: "
    "nccl-tests' 8-byte all-reduce on 8 H100s, 13.67 us over 14 steps (NVIDIA "
    "dgxc-benchmarking nccl/README.md)",
    "inter_node": "micro-benchmark: nccl-tests' ring bus bandwidth across nodes of 8 GPUs "
    "with a NIC each: a ring's channels cross nodes through every NIC at once, so a GPU's "
    "bus bandwidth is about the node's NICs together (NVIDIA in nccl-tests#319: 48 GB/s per "
    "CX7 400G NIC, ~396 GB/s a node with the ring; AWS p5 H100 all-reduce 355-357 GB/s on "
    "4-16 nodes, crazyguitar/aws-gpu-communication-benchmark; p5en H200 364.9, p6 B200 "
    "381.8 on 4 nodes, ml-engineering; DGX A100 8 x 200G: 192 GB/s, NVIDIA in nccl#812); "
    "latency per network step: NCCL's tuning model (src/graph/tuning.cc, 2.7-14 us)",
    "host_link": "micro-benchmark: nvbandwidth's pinned host<->device copies (H200 on PCIe "
    "Gen5: 55.4 GB/s each way, ml-engineering; A100 on Gen4: 25.1 GB/s, NVIDIA/nvbandwidth#42)",
    "host_memory_bytes_per_s": "datasheet: 8-channel DDR5-4800 per socket (307 GB/s), a "
    "third of it per GPU under 8 GPUs on 2 sockets",
    "op_overhead_s": "micro-benchmark: a kernel's launch through PyTorch's eager dispatcher, "
    "'between 5-20 microseconds' on the CPU side (Meta's HolisticTraceAnalysis docs; about "
    "2 us of it the dispatcher's own, pytorch#41383): the low end",
    "attention_fraction": "micro-benchmark: FlashAttention-2 forward+backward, causal, head "
    "dim 128, 8k tokens on an H100 SXM: 308 TFLOP/s (Dao-AILab/flash-attention README "
    "benchmark figure, 4f285b35) over that GPU's MAMF 794.5; on an A100, 182 of MAMF 271.2",
    "tensor_step_s": "micro-benchmark: fused AdamW + clip_grad_norm_ over DTensor shards, "
    "per parameter tensor, on this project's CPU host (fsdp-lab calibrate, 2026-11-29: "
    "18-42 us; 60 us kept for a GPU host's bigger DTensor dispatch): the host-side dispatch "
    "a GPU's step issues too",
    "grouped_fraction": "micro-benchmark: torch grouped_mm MoE forward on an H100 at ~2,048 "
    "rows an expert, 242.1 TFLOP/s (ByteDance-Seed/VeOmni PR #460) over the bf16 peak",
    "ranks_per_node": "datasheet: DGX/HGX nodes of 8 GPUs",
    "overlap_slowdown": "micro-benchmark: compute kernels run 18.9% slower on average (40% "
    "at most) while NCCL collectives overlap them, measured on A100, H100, MI250 and MI210 "
    "(Y. Zhang et al., arXiv 2507.03114)",
}


# Many parameters: one per column of a GPU's row, as its sources quote them (keyword-only).
def _gpu(
    name,
    bf16_tflops,
    fp8_tflops,
    *,
    fraction,
    fp8=None,
    hbm_tb_s,
    memory_gb,
    nvlink,
    network,
    host,
    attention=0.388,
    aliases=(),
    sources=None,
) -> DeviceProfile:
    """A GPU row: TFLOP/s, TB/s, GB and per-direction GB/s as the sources quote them (the
    fp32 and TF32 peaks from PEAK_TFLOPS)."""
    tf32, fp32 = peak_tflops(name.upper().replace("-", " "))[1:]
    compute = {"bf16": bf16_tflops * 1e12, "fp32": fp32 * 1e12, "tf32": tf32 * 1e12}
    if fp8_tflops:
        compute["fp8"] = fp8_tflops * 1e12
    return DeviceProfile(
        name=name,
        kind="gpu",
        compute=compute,
        matmul_fraction=fraction,
        fp8_fraction=fp8,
        memory_bytes_per_s=hbm_tb_s * 1e12,
        intra_node=Link(nvlink * GB, 1e-6),
        inter_node=Link(network * GB, 5e-6),
        host_link=Link(host * GB, 10e-6),
        host_memory_bytes_per_s=100 * GB,
        op_overhead_s=5e-6,
        overlap=True,
        attention_fraction=attention,
        shape_fraction=0.888,
        overlap_slowdown=0.189,
        tensor_step_s=60e-6,
        grouped_fraction=0.245,
        memory_bytes=int(memory_gb * GB),
        aliases=aliases,
        sources={**_GPU_SOURCES, **(sources or {})},
    )


# Named devices; docs/benchmarks.md ("Hardware profiles") cites every figure. Peaks: dense
# bf16/fp8 datasheet TFLOP/s. fraction, fp8: the maximum achievable matmul FLOP/s (MAMF,
# stas00/ml-engineering's table) over the peak. nvlink: nccl-tests' ring bus bandwidth on one
# 8-GPU node (GB/s); network: across nodes of 8 GPUs with a NIC each (GB/s a GPU, the ring's
# channels through every NIC); host: nvbandwidth's pinned copies (GB/s each way); attention:
# FlashAttention-2's causal forward+backward at head dim 128, 8k tokens, over MAMF.
DEVICES: tuple[DeviceProfile, ...] = (
    _gpu(
        "a100-40gb",
        312,
        0,
        fraction=0.869,
        hbm_tb_s=1.555,
        memory_gb=40,
        nvlink=235,
        network=192,
        host=25,
        attention=0.671,
        aliases=("a100_40gb", "a100-40"),
    ),
    _gpu(
        "a100-80gb",
        312,
        0,
        fraction=0.869,
        hbm_tb_s=2.039,
        memory_gb=80,
        nvlink=235,
        network=192,
        host=25,
        attention=0.671,
        aliases=("a100", "a100_80gb", "a100-80"),
    ),
    _gpu(
        "h100",
        989,
        1979,
        fraction=0.803,
        fp8=0.709,
        hbm_tb_s=3.35,
        memory_gb=80,
        nvlink=361,
        network=356,
        host=55,
        aliases=("h100-sxm", "h100_sxm"),
    ),
    _gpu(
        "h200",
        989,
        1979,
        fraction=0.803,
        fp8=0.734,
        hbm_tb_s=4.8,
        memory_gb=141,
        nvlink=361,
        network=365,
        host=55,
        aliases=("h200-sxm",),
    ),
    _gpu(
        "b200",
        2250,
        4500,
        fraction=0.776,
        fp8=0.763,
        hbm_tb_s=8.0,
        memory_gb=180,
        nvlink=682,
        network=382,
        host=55,
        sources={
            "attention_fraction": "micro-benchmark: the H100's (FlashAttention-2 at head dim "
            "128, 8k tokens, over MAMF); no B200 figure is published",
            "grouped_fraction": "micro-benchmark: the H100's (VeOmni PR #460); no B200 "
            "figure is published",
        },
    ),
    # Meta's Grand Teton H100s, as torchtitan's H100 benchmarks ran them: 96 GB of HBM2e at
    # 2.4 TB/s, a 500 W power limit, 400 Gb/s RoCE a GPU (torchtitan benchmarks/
    # llama3_h100_202412_torchtitan.md). No datasheet gives a 500 W part's peak: the H100
    # NVL's (a power-limited H100, 835 TFLOP/s dense bf16 at 350-400 W) is the nearest.
    _gpu(
        "h100-96gb-500w",
        835,
        1671,
        fraction=0.803,
        fp8=0.709,
        hbm_tb_s=2.4,
        memory_gb=96,
        nvlink=361,
        network=356,
        host=55,
        aliases=("h100-500w", "grand-teton-h100"),
        sources={
            "compute": "datasheet: NVIDIA H100 NVL's dense peaks (835 bf16, 1671 fp8 TFLOP/s "
            "at 350-400 W), the nearest published for torchtitan's 500 W-capped H100",
            "memory_bytes_per_s": "datasheet: torchtitan's benchmark states 96 GB HBM2e at "
            "2.4 TB/s (benchmarks/llama3_h100_202412_torchtitan.md)",
            "memory_bytes": "datasheet: torchtitan's benchmark states 96 GB HBM2e",
        },
    ),
    # CPU ranks with nothing measured: a rank of this project's 2-core CI VM as fsdp-lab
    # calibrate measured it. A run on another machine measures its own (planning.machine).
    DeviceProfile(
        name="cpu",
        kind="cpu",
        compute={"fp32": 100e9, "bf16": 15e9, "fp16": 10e9},
        matmul_fraction=1.0,
        memory_bytes_per_s=20 * GB,
        intra_node=Link(1.0 * GB, 50e-6),
        inter_node=Link(1.0 * GB, 100e-6),
        host_link=Link(20 * GB, 1e-6),
        host_memory_bytes_per_s=20 * GB,
        op_overhead_s=4e-6,
        view_overhead_s=1e-6,
        tensor_step_s=200e-6,
        attention_fraction=0.45,
        overlap=False,
        ranks_per_node=2,
        sources={
            k: "micro-benchmark: fsdp-lab calibrate hardware=cpu on this project's 2-core CI "
            "VM (2026-11-29, torch 2.13 CPU, 2 ranks), rounded"
            for k in (
                "compute",
                "matmul_fraction",
                "memory_bytes_per_s",
                "intra_node",
                "inter_node",
                "host_link",
                "host_memory_bytes_per_s",
                "op_overhead_s",
                "view_overhead_s",
                "tensor_step_s",
                "attention_fraction",
                "ranks_per_node",
                "shape_fraction",
            )
        },
    ),
)


def named_devices() -> list[str]:
    return [d.name for d in DEVICES]


def row_for(hardware: str) -> str | None:
    """The named row for a machine as a run's hardware line describes it (``gpu: 8 x NVIDIA
    H100 80GB HBM3``, ``cpu: 2 cores``): the GPU's model, an A100 by its memory; cpu for CPU
    ranks; None for a GPU no row describes (the caller says so: it is not priced as another)."""
    text = hardware.lower().replace(" ", "")
    if not text.startswith("gpu"):
        return "cpu"
    for d in DEVICES:
        if d.kind == "gpu" and d.name.split("-")[0] in text:
            if d.name.startswith("a100"):
                return "a100-40gb" if "40gb" in text else "a100-80gb"
            return d.name
    return None


def setting(flag: str, value: str) -> str:
    """``--device h100`` or ``hardware.profile=h100``: a setting as the user wrote it."""
    return f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}"


def device_profile(name_or_path: str, flag: str = "--device") -> DeviceProfile:
    """A named device (or alias), or a profile file ``fsdp-lab calibrate`` wrote; ``flag``
    is the setting that named it, for the error."""
    key = name_or_path.strip().lower()
    for d in DEVICES:
        if key == d.name or key in d.aliases:
            return d
    path = Path(name_or_path).expanduser()
    if path.exists() or len(path.parts) > 1:  # a file, or a path to one
        return read_profile(path)
    raise ConfigError(
        f"{setting(flag, name_or_path)}: not a known device ({', '.join(named_devices())}) nor a "
        "profile file; name one, or give the JSON fsdp-lab calibrate wrote"
    )
