"""Hardware profiles: what a device computes and moves per second (``DeviceProfile``), the
named rows' table being ``config.device_rows``, and the file ``fsdp-lab calibrate`` writes of
the machine it measured. The time model
(``planning.time_model``) reads them; so does MFU (``PEAK_TFLOPS``). Imports no torch.

Every figure of a named row is the vendor's or a public measurement's; docs/benchmarks.md ("The
time model") cites each. Bandwidths are *bus* bandwidths per rank in one direction, as
nccl-tests reports them: a ring all-gather of S bytes over n ranks moves (n-1)/n x S through
each rank's link, an all-reduce twice that.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.config.errors import ConfigError
from fsdp_lab.config.precisions import peak_key

PROFILE_VERSION = 2  # calibrate's file format; another version is refused, not guessed at
GB = 1e9
# Where a figure may come from: a vendor's datasheet, a micro-benchmark (which, on what), a fit
# (to which data), or a count (of operations or bytes in code). Every figure of a named row
# says which (``DeviceProfile.sources``); a test holds every row to it.
SOURCE_KINDS = ("datasheet", "micro-benchmark", "fit", "count")

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


@dataclass(frozen=True)
class Rate:
    """The cost of one class of operator, as calibrate fits it over the sizes it measured:
    ``latency_s`` a call plus its work at ``per_s`` (FLOP/s for matrix multiplies and
    attention)."""

    per_s: float
    latency_s: float = 0.0

    def seconds(self, work: float, calls: float = 1.0) -> float:
        return calls * self.latency_s + work / self.per_s


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
    collective is waited for as it is issued, measured with profile=trace).

    A measured profile (``fsdp-lab calibrate``) also has rates fitted over the sizes it ran
    (``matmul``, ``attention``, ``memory_by_size``), which take precedence over the peak's
    fractions, and the host's costs of what a run issues besides kernels."""

    name: str
    kind: str  # gpu | cpu
    compute: dict[str, float]  # FLOP/s by dtype name
    matmul_fraction: float  # the best shape's achievable share of the peak (MAMF)
    memory_bytes_per_s: float
    intra_node: Link
    inter_node: Link
    host_link: Link
    host_memory_bytes_per_s: float
    op_overhead_s: float
    overlap: bool
    memory_bytes: int = 0  # the device's memory (0: the host's, unbounded here)
    fp8_fraction: float | None = None  # float8 matmuls' achievable fraction (None: as bf16's)
    # a model's own matmul shapes against the best shape's rate (a named row: measured on a
    # training step's kernels; a measured profile's rates are of its own shapes: 1)
    shape_fraction: float = 1.0
    attention_fraction: float = 0.4  # attention kernels' FLOP rate over the matmuls'
    tensor_step_s: float = 60e-6  # optimizer step + clipping's issue cost per parameter tensor
    optimizer_step_s: float = 0.0  # ...and per step (the norm's all-reduce, the setup)
    # A mixture of experts' grouped GEMMs: their achievable fraction of the peak (None: as
    # dense matmuls')
    grouped_fraction: float | None = None
    ranks_per_node: int = 8  # a node as the vendors build it (DGX/HGX: 8 GPUs)
    # A measured profile: a link per collective (COLLECTIVES) where the backend prices them
    # differently (gloo reduce-scatters by all-reducing the whole input)
    collectives: dict[str, Link] = field(default_factory=dict)
    # A measured profile: matrix multiplies, "<dtype> <forward|backward>" -> their fitted rate
    # (FLOPs as plan_trace counts them); attention's FLOP/s by head size and tokens, as
    # measured; other operators' bytes/s by their size class (log2 of the bytes one operator
    # reads and writes: cache-resident ones are faster)
    matmul: dict[str, Rate] = field(default_factory=dict)
    attention: dict[str, list[list[float]]] = field(default_factory=dict)  # [dim, tokens, FLOP/s]
    memory_by_size: dict[int, float] = field(default_factory=dict)
    view_overhead_s: float = 0.0  # a view (metadata only): its dispatch on the host
    unit_overhead_s: float = 0.0  # FSDP2's hooks around one unit's forward or backward, host
    tp_linear_s: float = 0.0  # a tensor-parallel linear's DTensor dispatch, per pass
    # The share of a unit's compute a rank waits at the next collective for the slowest rank
    # (the same work runs at different speeds on shared cores)
    straggle: float = 0.0
    # A step's host cost nothing else prices (the loss's scale, the micro-batches' bookkeeping,
    # Python between the pieces): measured on calibrate's tiny model's whole step
    step_host_s: float = 0.0
    # How much slower kernels run while a collective overlaps them (they share the GPU's SMs
    # and memory), per second of overlapped communication
    overlap_slowdown: float = 0.0
    # calibrate --from-runs: what the user's own runs taught the profile (scales of the
    # predicted compute and exposed communication, a step's unmodelled host time)
    learned: dict = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field -> where its figure comes from
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
            fraction *= self.shape_fraction
        return self.compute[dtype] * fraction

    def matmul_s(self, flops: float, calls: float, dtype: str, phase: str) -> float:
        """Seconds of ``calls`` matrix multiplies of ``flops`` in all: the measured rate of
        this dtype and pass, else the achievable fraction of the peak."""
        rate = self.matmul.get(f"{_measured_dtype(self, dtype)} {phase}")
        if rate is not None:
            return rate.seconds(flops, calls)
        return flops / self.flops(dtype)

    def attention_s(
        self,
        flops: float,
        dtype: str,
        phase: str,
        head_dim: int = 0,
        tokens: int = 0,
    ) -> float:
        """Seconds of attention kernels of ``flops`` (causal: half the scores counted) over
        ``tokens`` keys a head of ``head_dim``: at the measured FLOP rate of the nearest head
        size, interpolated between the lengths measured (log scale; the ends held beyond),
        else at the attention kernels' fraction of the matmuls' rate."""
        points = self.attention.get(f"{_measured_dtype(self, dtype)} {phase}")
        if not points:
            return flops / (self.flops(dtype) * self.attention_fraction)
        dims = {p[0] for p in points}
        dim = min(dims, key=lambda d: abs(math.log(d / head_dim))) if head_dim else max(dims)
        line = sorted((p[1], p[2]) for p in points if p[0] == dim)
        return flops / _interpolate(line, tokens or line[-1][0])

    def bytes_s(self, nbytes: float, bucket: int | None = None) -> float:
        """Seconds an elementwise operator moving ``nbytes`` takes at the memory's bandwidth
        (a measured profile's at the nearest size it measured)."""
        if bucket is not None and self.memory_by_size:
            near = min(self.memory_by_size, key=lambda b: abs(b - bucket))
            return nbytes / self.memory_by_size[near]
        return nbytes / self.memory_bytes_per_s

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
            body["matmul"] = {k: Rate(**v) for k, v in body.get("matmul", {}).items()}
            body["memory_by_size"] = {int(k): v for k, v in body.get("memory_by_size", {}).items()}
            body["aliases"] = tuple(body.get("aliases", ()))
            return cls(**{**body, **links})
        except (KeyError, TypeError) as e:
            raise ConfigError(
                f"{source} is not a complete hardware profile ({e}): run fsdp-lab calibrate "
                "again to write a new one"
            ) from None


def _interpolate(line: list[tuple[float, float]], x: float) -> float:
    """y at ``x`` on a line of (x, y) points, linear in log x between them, held beyond."""
    if x <= line[0][0]:
        return line[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(line):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return line[-1][1]


def _measured_dtype(p: DeviceProfile, dtype: str) -> str:
    """The dtype a measured rate is keyed by (fp16 at bf16's where only bf16 was measured)."""
    return dtype if f"{dtype} forward" in p.matmul else peak_key(dtype)


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # two writers never share one
    try:
        tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
