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
    "memory_bytes_per_s": "datasheet: NVIDIA's HBM bandwidth",
    "memory_bytes": "datasheet: NVIDIA's HBM capacity",
    "intra_node": "micro-benchmark: nccl-tests' bus bandwidth on one 8-GPU node "
    "(all-gather, reduce-scatter, ring all-reduce; ml-engineering network/README.md); latency "
    "per ring step: nccl-tests' 8-byte all-reduce on 8 H100s, 13.67 us over 14 steps "
    "(NVIDIA dgxc-benchmarking nccl/README.md)",
    "inter_node": "micro-benchmark: a 4-node ring all-reduce on 8 x 400 Gb/s nodes reaching "
    "36.95 of 50 GB/s per GPU (74%; ml-engineering network/README.md), applied to each "
    "node's adapters (datasheet: DGX A100 8 x 200 Gb/s HDR, DGX H100 8 x 400 Gb/s NDR); "
    "latency per network step: NCCL's tuning model (src/graph/tuning.cc, 2.7-14 us)",
    "host_link": "datasheet: PCIe Gen4/Gen5 x16 per direction (32/64 GB/s) at 80%, the "
    "ratio nvbandwidth reports for pinned host-device copies (NVIDIA/nvbandwidth README)",
    "host_memory_bytes_per_s": "datasheet: 8-channel DDR5-4800 per socket (307 GB/s), a "
    "third of it per GPU under 8 GPUs on 2 sockets",
    "op_overhead_s": "micro-benchmark: an empty CUDA kernel's launch through PyTorch's "
    "eager dispatcher, 4-6 us (PyTorch dev-discuss 'Overhead in PyTorch eager', H100)",
    "attention_fraction": "micro-benchmark: FlashAttention-2 forward+backward, causal, head "
    "dim 128, 8k tokens on an H100 SXM: 335 TFLOP/s (FlashAttention-3 paper, Shah et al. "
    "2024, Fig. 5) over that GPU's MAMF 794.5",
    "tensor_step_s": "micro-benchmark: fused AdamW + clip_grad_norm_ over DTensor shards, "
    "per parameter tensor, on this project's CPU host (fsdp-lab calibrate, 2026-11-29): the "
    "host-side dispatch a GPU's step issues too",
    "grouped_fraction": "micro-benchmark: torch grouped_mm MoE forward on an H100 at ~2,048 "
    "rows an expert, 242.1 TFLOP/s (ByteDance-Seed/VeOmni PR #460) over the bf16 peak",
    "ranks_per_node": "datasheet: DGX/HGX nodes of 8 GPUs",
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
        attention_fraction=0.42,
        tensor_step_s=60e-6,
        grouped_fraction=0.245,
        memory_bytes=int(memory_gb * GB),
        aliases=aliases,
        sources={**_GPU_SOURCES, **(sources or {})},
    )


# Named devices; docs/benchmarks.md ("Hardware profiles") cites every figure. Peaks: dense
# bf16/fp8 datasheet TFLOP/s. fraction, fp8: the maximum achievable matmul FLOP/s (MAMF,
# stas00/ml-engineering's table) over the peak. nvlink: nccl-tests' all-gather / ring
# all-reduce bus bandwidth on one 8-GPU node (GB/s, ~78-80% of NVLink's per-direction rate);
# network: 74% of the per-GPU adapter's line rate (HDR 200 Gb/s on DGX A100, NDR 400 Gb/s
# on H100/H200/B200 nodes: the measured 4-node ring all-reduce efficiency); host: PCIe Gen4
# x16 (A100) or Gen5 x16 (later) at 80%.
DEVICES: tuple[DeviceProfile, ...] = (
    _gpu(
        "a100-40gb",
        312,
        0,
        fraction=0.869,
        hbm_tb_s=1.555,
        memory_gb=40,
        nvlink=235,
        network=18.5,
        host=25,
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
        network=18.5,
        host=25,
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
        network=37,
        host=50,
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
        network=37,
        host=50,
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
        network=37,
        host=50,
    ),
    # CPU ranks with nothing measured: a rank of this project's 2-core CI VM as fsdp-lab
    # calibrate measured it. A run on another machine measures its own (tools.machine).
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


def device_profile(name_or_path: str) -> DeviceProfile:
    """A named device (or alias), or a profile file ``fsdp-lab calibrate`` wrote."""
    key = name_or_path.strip().lower()
    for d in DEVICES:
        if key == d.name or key in d.aliases:
            return d
    path = Path(name_or_path).expanduser()
    if path.exists() or len(path.parts) > 1:  # a file, or a path to one
        return read_profile(path)
    raise ConfigError(
        f"--device {name_or_path}: not a known device ({', '.join(named_devices())}) nor a "
        "profile file; name one, or give the JSON fsdp-lab calibrate wrote"
    )
