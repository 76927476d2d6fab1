"""Hardware profiles: what a device computes and moves per second, one row per named device,
and the file ``fsdp-lab calibrate`` writes of the machine it measured. The time model
(``tools.time_model``) reads them; so does MFU (``PEAK_TFLOPS``). Imports no torch.

Every figure of a named row is the vendor's or a public measurement's; docs/benchmarks.md ("The
time model") cites each. Bandwidths are *bus* bandwidths per rank in one direction, as
nccl-tests reports them: a ring all-gather of S bytes over n ranks moves (n-1)/n x S through
each rank's link, an all-reduce twice that.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.config.errors import ConfigError
from fsdp_lab.config.precisions import peak_key

PROFILE_VERSION = 1  # calibrate's file format; another version is refused, not guessed at
GB = 1e9

# Dense peak TFLOP/s per GPU from the vendors' datasheets (no sparsity): bf16/fp16 tensor
# cores, TF32 tensor cores, and fp32 without TF32. Matched in order against
# the CUDA device name torch reports, so the more specific names come first. MFU divides by these.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100", 989.0, 494.7, 67.0),
    ("H200", 989.0, 494.7, 67.0),
    ("H800", 989.0, 494.7, 67.0),
    ("B200", 2250.0, 1100.0, 80.0),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("L4", 121.0, 60.0, 30.3),
    ("A10G", 70.0, 35.0, 31.2),
    ("A10", 125.0, 62.5, 31.2),
)


def peak_tflops(device_name: str) -> tuple[float, float, float] | None:
    """(bf16, tf32, fp32) dense peak TFLOP/s of a GPU named as torch reports CUDA devices;
    None for one the table does not know."""
    return next((row[1:] for row in PEAK_TFLOPS if row[0] in device_name), None)


@dataclass(frozen=True)
class Link:
    """A collective's cost over one kind of link: ``latency_s`` per ring step, and the bus
    bandwidth each rank achieves (bytes/s, one direction)."""

    bytes_per_s: float
    latency_s: float


# The collectives a profile prices; a measured profile may give each its own link.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class DeviceProfile:
    """One device, as the time model prices a step on it.

    ``compute``: dense peak FLOP/s per compute dtype (bf16, fp16, fp32, fp8), of which matmuls
    reach ``matmul_fraction``; other operators move bytes at ``memory_bytes_per_s`` and cost
    ``op_overhead_s`` each to issue (on a GPU the host issues them ahead of the device, so
    they cost time only where a unit's kernels are shorter than their launches; on a CPU
    every operator waits for the one before). ``intra_node``/``inter_node``: collectives within
    a node and across nodes; ``host_link``: copies between host and device (offload);
    ``host_memory_bytes_per_s``: the host's memory, where an offloaded optimizer steps.
    ``overlap``: FSDP2 hides a unit's collectives under compute (GPU streams; on CPU every
    collective is waited for as it is issued, measured with profile=trace)."""

    name: str
    kind: str  # gpu | cpu
    compute: dict[str, float]  # FLOP/s by dtype name
    matmul_fraction: float
    memory_bytes_per_s: float
    intra_node: Link
    inter_node: Link
    host_link: Link
    host_memory_bytes_per_s: float
    op_overhead_s: float
    overlap: bool
    memory_bytes: int = 0  # the device's memory (0: the host's, unbounded here)
    fp8_fraction: float | None = None  # float8 matmuls' achievable fraction (None: as bf16's)
    # Causal attention's FLOP rate (half the scores counted) over the matmuls' achievable one:
    # measured by calibrate; on GPUs FlashAttention-2's ~335 TFLOP/s on an H100 at head dim
    # 128 (fwd+bwd) against its 794 MAMF, and less at head dim 64: 0.4 is an assumption
    attention_fraction: float = 0.4
    # The optimizer step and gradient clipping's issue cost per parameter tensor (DTensor
    # dispatch; the norm's all-reduce shared out), measured by calibrate; 60 us on a GPU's
    # host is an assumption
    tensor_step_s: float = 60e-6
    # A mixture of experts' grouped GEMMs (torch's grouped_mm over tokens sorted by expert):
    # their achievable fraction of the peak, None: as dense matmuls'. Measured by calibrate at
    # the model's experts; on GPUs 0.245, VeOmni's torch grouped_mm MoE forward on an H100 at
    # ~2,048 rows an expert (hidden 2048, 128 experts, top 8), and an assumption elsewhere
    grouped_fraction: float | None = None
    ranks_per_node: int = 8  # a node as the vendors build it (DGX/HGX: 8 GPUs)
    # A measured profile: a link per collective (COLLECTIVES) where the backend prices them
    # differently (gloo reduce-scatters by all-reducing the whole input)
    collectives: dict[str, Link] = field(default_factory=dict)
    # A measured profile: matmul FLOP/s at named shapes, e.g. "2048x256x1024" (M x K x N)
    matmul_at: dict[str, float] = field(default_factory=dict)
    measured: dict | None = None  # calibrate's record: when, where, ranks, spread, versions
    aliases: tuple[str, ...] = ()

    def link(self, op: str, *, across_nodes: bool) -> Link:
        """The link a collective ``op`` runs at: the measured one for ``op`` (a calibrated
        profile measured its own ranks, within one node), else the node's or the network's."""
        if op in self.collectives and not across_nodes:
            return self.collectives[op]
        return self.inter_node if across_nodes else self.intra_node

    def flops(self, dtype: str, fraction: float | None = None) -> float:
        """Achievable matmul FLOP/s computing in ``dtype`` (one the profile has no figure of
        at its precision row's peak: fp16 at bf16's), at ``fraction`` of the peak (default:
        the matmuls', float8's own)."""
        if dtype not in self.compute:
            dtype = peak_key(dtype)
        if dtype not in self.compute:
            raise ConfigError(
                f"--device {self.name} has no {dtype} FLOP/s; it has "
                f"{', '.join(self.compute)}: choose another precision or device"
            )
        if fraction is None:
            fraction = (self.fp8_fraction if dtype == "fp8" else None) or self.matmul_fraction
        return self.compute[dtype] * fraction

    def grouped_flops(self, dtype: str) -> float:
        """Achievable FLOP/s of a mixture of experts' grouped GEMMs computing in ``dtype``."""
        return self.flops(dtype, self.grouped_fraction)

    def to_json(self) -> dict:
        return {"fsdp_lab_profile": PROFILE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict, source: str = "profile") -> DeviceProfile:
        version = data.get("fsdp_lab_profile") if isinstance(data, dict) else None
        if version != PROFILE_VERSION:
            raise ConfigError(
                f"{source} is a hardware profile of format {version!r}, this fsdp_lab reads "
                f"{PROFILE_VERSION}: run fsdp-lab calibrate again to write a new one"
            )
        body = {k: v for k, v in data.items() if k != "fsdp_lab_profile"}
        try:
            links = {k: Link(**body[k]) for k in ("intra_node", "inter_node", "host_link")}
            body["collectives"] = {k: Link(**v) for k, v in body.get("collectives", {}).items()}
            body["aliases"] = tuple(body.get("aliases", ()))
            return cls(**{**body, **links})
        except (KeyError, TypeError) as e:
            raise ConfigError(
                f"{source} is not a complete hardware profile ({e}): run fsdp-lab calibrate "
                "again to write a new one"
            ) from None


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
        # per ring step: nccl-tests' 8-byte all-reduce on 8 H100s, 13.7 us over 14 steps;
        # NCCL's own tuning model puts a network step at 2.7-14 us
        intra_node=Link(nvlink * GB, 1e-6),
        inter_node=Link(network * GB, 5e-6),
        host_link=Link(host * GB, 10e-6),
        host_memory_bytes_per_s=100 * GB,
        op_overhead_s=5e-6,
        overlap=True,
        grouped_fraction=0.245,
        memory_bytes=int(memory_gb * GB),
        aliases=aliases,
    )


# Named devices; docs/benchmarks.md ("Hardware profiles") cites every figure. Peaks: dense
# bf16/fp8 datasheet TFLOP/s. fraction, fp8: the maximum achievable matmul FLOP/s (MAMF,
# stas00/ml-engineering's table) over the peak. nvlink: nccl-tests' all-gather / ring
# all-reduce bus bandwidth on one 8-GPU node (GB/s, ~78-80% of NVLink's per-direction rate);
# network: 74% of the per-GPU adapter's line rate (HDR 200 Gb/s on DGX A100, NDR 400 Gb/s
# on H100/H200/B200 nodes: the measured 4-node ring all-reduce efficiency); host: PCIe Gen4
# x16 (A100) or Gen5 x16 (later) at ~80% (an assumption, not measured).
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
    # CPU ranks: a rank of a 2-core cloud VM, as measured here (fp32 only; gloo on
    # loopback): a starting point, `fsdp-lab calibrate` measures the machine at hand.
    DeviceProfile(
        name="cpu",
        kind="cpu",
        compute={"fp32": 60e9, "bf16": 15e9, "fp16": 10e9},
        matmul_fraction=1.0,
        memory_bytes_per_s=5 * GB,
        intra_node=Link(1.0 * GB, 50e-6),
        inter_node=Link(1.0 * GB, 100e-6),
        host_link=Link(5 * GB, 1e-6),
        host_memory_bytes_per_s=5 * GB,
        op_overhead_s=5e-6,
        tensor_step_s=600e-6,
        attention_fraction=0.5,
        overlap=False,
        ranks_per_node=2,
    ),
)


def named_devices() -> list[str]:
    return [d.name for d in DEVICES]


def row_for(hardware: str) -> str:
    """The named row for a machine as a run's hardware line describes it (``gpu: 8 x NVIDIA
    H100 80GB HBM3``, ``cpu: 2 cores``): the GPU's model, an A100 by its memory; an H100 for
    another GPU; cpu for CPU ranks."""
    text = hardware.lower().replace(" ", "")
    if not text.startswith("gpu"):
        return "cpu"
    for d in DEVICES:
        if d.kind == "gpu" and d.name.split("-")[0] in text:
            if d.name.startswith("a100"):
                return "a100-40gb" if "40gb" in text else "a100-80gb"
            return d.name
    return "h100"


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


def read_profile(path: Path) -> DeviceProfile:
    """A profile file; a missing, unreadable or foreign one is a one-line ConfigError."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--device {path}: no such profile file; write one with fsdp-lab calibrate --out {path}"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--device {path}: not a readable profile ({e}); calibrate again"
        ) from None
    return DeviceProfile.from_json(data, source=str(path))


def write_profile(profile: DeviceProfile, path: Path) -> None:
    """Write a profile whole or not at all (a temporary file renamed over the target)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    tmp.replace(path)
