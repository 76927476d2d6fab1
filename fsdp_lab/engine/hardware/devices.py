"""The device a run has and what it can do: resolved and checked before launch, then set
up in each rank (its device, random state, batches, waits and step timing).

The launcher calls the checks and ``device_summary`` too: nothing here before ``rank_device``
starts the XLA runtime, which on a TPU host only one process may hold.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import time

import torch

from fsdp_lab.config import (
    Backend,
    ConfigError,
    Dtype,
    ExpertsImplementation,
    HardwareConfig,
    HardwareKind,
)
from fsdp_lab.config.hardware_kinds import hardware_row, kind_of, resolved
from fsdp_lab.config.precisions import DTYPES, dtype_row

TORCH_DTYPES = {dtype: getattr(torch, row.torch_name) for dtype, row in DTYPES.items()}

# torch_xla pins the torch it was built against; this is the pair the tests run.
XLA_PAIR = ("2.9.0", "2.9.0")  # (torch, torch-xla)

XLA_INSTALL = (
    f"pip install 'fsdp_lab[tpu]' (torch=={XLA_PAIR[0]} with torch-xla=={XLA_PAIR[1]}"
    ", in an environment of its own; see the README)"
)


# ---- before launch: the device and what it can run ------------------------------------------
def resolve_kind(cfg: HardwareConfig) -> HardwareKind:
    """auto becomes the GPU kind when CUDA is usable, else the host's; a kind whose device this
    machine lacks is an error naming the fix."""
    kind = resolved(cfg.kind, cuda=torch.cuda.is_available())
    match hardware_row(kind).device_type:
        case "cuda" if not torch.cuda.is_available():
            raise ConfigError(
                f"hardware={kind.name} but CUDA is not available on this machine; use "
                f"hardware={kind_of('cpu').name} (or hardware=auto)"
            )
        case "xla":
            check_xla_env()
    return kind


def check_xla_env() -> None:
    """hardware=tpu needs torch_xla next to the exact torch it was built for, and a PJRT device
    it can drive (TPU, or CPU for testing); PJRT_DEVICE defaults to TPU."""
    if importlib.util.find_spec("torch_xla") is None:
        raise ConfigError(f"hardware=tpu needs torch_xla, which is not installed: {XLA_INSTALL}")
    xla = importlib.metadata.version("torch_xla").split("+")[0]
    base = torch.__version__.split("+")[0]
    if xla.split(".")[:2] != base.split(".")[:2]:
        raise ConfigError(
            f"hardware=tpu: torch-xla {xla} needs torch {xla}, this environment has "
            f"torch {base}; {XLA_INSTALL}"
        )
    os.environ.setdefault("PJRT_DEVICE", "TPU")
    if os.environ["PJRT_DEVICE"] not in ("TPU", "CPU"):
        raise ConfigError(
            f"hardware=tpu with PJRT_DEVICE={os.environ['PJRT_DEVICE']}: use "
            "PJRT_DEVICE=TPU (or CPU, XLA's CPU devices, for testing)"
        )


def xla_local_devices() -> int:
    """XLA devices on this host, without starting the XLA runtime (on a TPU host only one
    process may hold the chips, and the launcher's rank must be that one)."""
    if os.environ.get("PJRT_DEVICE") == "CPU":
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    from torch_xla._internal import tpu

    return tpu.num_available_devices()


def local_devices(kind: HardwareKind) -> int:
    """The kind's devices on this host (CPU ranks are processes: the cores)."""
    match hardware_row(kind).device_type:
        case "cuda":
            return torch.cuda.device_count()
        case "xla":
            return xla_local_devices()
        case _:
            return os.cpu_count() or 1


# Why a host has no device of a type, and the fix (``local_devices`` found none).
NONE_FOUND = {
    "cuda": "found no GPU; use hardware=cpu",
    "xla": "found no XLA device; on a TPU VM check its chips, or set PJRT_DEVICE=CPU "
    "CPU_NUM_DEVICES=N to run on XLA's CPU devices",
}


def none_found(kind: HardwareKind) -> str:
    return f"hardware={kind.name} {NONE_FOUND[hardware_row(kind).device_type]}"


def default_nproc_per_node(kind: HardwareKind) -> int:
    """The row's default ranks, or one per device of this host."""
    ranks = hardware_row(kind).default_ranks
    return local_devices(kind) if ranks is None else ranks


def processes_per_node(kind: HardwareKind, nproc_per_node: int) -> int:
    """Processes to start per node: one per rank, except where one SPMD process drives every
    device of its host (each device is one data-parallel rank)."""
    return 1 if hardware_row(kind).one_process_per_host else nproc_per_node


def check_nproc(kind: HardwareKind, nproc_per_node: int, chosen: Backend = Backend.auto) -> None:
    """One rank per GPU under NCCL (it refuses two on one device; gloo lets ranks share); an
    SPMD process uses every device of its host."""
    row, here = hardware_row(kind), local_devices(kind)
    if row.nccl and chosen is not Backend.gloo and nproc_per_node > here:
        raise ConfigError(
            f"hardware.nproc_per_node={nproc_per_node} but only {here} GPUs are "
            "visible; lower hardware.nproc_per_node (one rank per GPU), or set "
            "hardware.backend=gloo to share the GPUs among ranks (slow: for checking a sharded "
            "layout)"
        )
    if row.one_process_per_host and nproc_per_node != here:
        raise ConfigError(
            f"hardware.nproc_per_node={nproc_per_node} but this host has {here} "
            "XLA devices and SPMD uses all of them; remove hardware.nproc_per_node (with "
            "PJRT_DEVICE=CPU, CPU_NUM_DEVICES sets the count)"
        )


def check_dtype(kind: HardwareKind, dtype: Dtype, setting: str) -> None:
    """Fail before launch when the device cannot compute or reduce in ``dtype``.

    gloo reduces fp16 and bf16 (checked on torch 2.13) and CPU kernels cover both; on GPU,
    bf16 needs an Ampere-or-newer device (NCCL and the matmuls both rely on it).
    """
    probe = dtype_row(dtype).gpu_probe
    cuda = hardware_row(kind).device_type == "cuda"
    if cuda and probe is not None and not getattr(torch.cuda, probe)():
        others = [d.name for d, row in DTYPES.items() if row.gpu_probe is None]
        raise ConfigError(
            f"{setting}={dtype.name} but this GPU has no {dtype.name} support; use "
            f"precision.param_dtype={'/'.join(others)}"
        )


def check_experts_implementation(implementation: ExpertsImplementation) -> None:
    """Fail before launch on an experts kernel this torch lacks: ``grouped_mm`` calls
    ``torch.nn.functional.grouped_mm`` (torch >= 2.9; a CPU kernel too). A device that cannot
    run it refuses it in its row (``Feature.grouped_mm``)."""
    if implementation is not ExpertsImplementation.grouped_mm:
        return
    if not hasattr(torch.nn.functional, "grouped_mm"):
        raise ConfigError(
            f"model.experts_implementation=grouped_mm needs torch.nn.functional.grouped_mm "
            f"(torch >= 2.9), which torch {torch.__version__} lacks; use eager or batched_mm"
        )


def slow_cpu_dtype(kind: HardwareKind, dtype: Dtype) -> str | None:
    """Why computing in ``dtype`` on this CPU is slow, or None. Without bf16/fp16 instructions
    (AVX512-BF16, AMX; an AVX2 machine has neither) oneDNN falls back to generic kernels:
    measured on a 2-core AVX2 EPYC, a bf16 matmul of 256x49152 by 49152x576 took 40 s, the
    same in fp32 0.5 s, and a SmolLM2-135M step at 2x128 tokens 100 s in bf16."""
    probe = dtype_row(dtype).cpu_probe
    if not hardware_row(kind).host or probe is None:
        return None
    supported = getattr(torch.ops.mkldnn, probe, None)
    if supported is None or supported():
        return None
    return (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {dtype.value} "
        f"matmuls: {dtype.value} compute runs tens of times slower than fp32 here"
    )


def check_compile(kind: HardwareKind) -> None:
    """torch.compile's CPU backend (inductor) builds C++; without a compiler it fails late."""

    needs = hardware_row(kind).compile_needs_compiler
    if needs and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError(
            f"compile=true on hardware={kind.name} needs a C++ compiler (g++ or clang++) on "
            "PATH; install one or set compile=false"
        )


def device_summary(kind: HardwareKind) -> str:
    """The device in one line (the launch log and the report); never starts the XLA runtime
    (the launcher calls it too)."""
    match hardware_row(kind).device_type:
        case "cuda":
            return f"{kind.name}: {local_devices(kind)} x {torch.cuda.get_device_name(0)}"
        case "xla":
            return (
                f"{kind.name}: {xla_local_devices()} XLA devices (PJRT_DEVICE="
                f"{os.environ.get('PJRT_DEVICE')}), torch_xla SPMD"
            )
        case _:
            return f"{kind.name}: {os.cpu_count()} cores"


# ---- in a rank: its device, and work on it --------------------------------------------------
def set_threads(cfg: HardwareConfig, nproc_per_node: int) -> int:
    """Split the node's cores among its ranks: two threads per rank on two cores is slower."""
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc_per_node)
    torch.set_num_threads(threads)
    return threads


def rank_device(kind: HardwareKind, local_rank: int) -> torch.device:
    """One GPU per rank: the local rank's among the visible ones (under srun --gpus-per-task
    each task sees only its own, device 0). On tpu the SPMD device, which stands for all of the
    host's XLA devices: SPMD mode is switched on here, before any XLA tensor exists."""
    match hardware_row(kind).device_type:
        case "cuda":
            index = local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        case "xla":
            import torch_xla
            import torch_xla.runtime as xr

            xr.use_spmd()
            return torch_xla.device()
        case other:
            return torch.device(other)


def xla_runtime_devices() -> int:
    """Every XLA device the runtime drives (after ``rank_device``)."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def device_rng_state(device: torch.device) -> dict | None:
    """The device's own random state beside torch's CPU one (None where it has none), tagged
    with the device type: a checkpoint may be resumed on other hardware."""
    if device.type == "cuda":
        return {"type": "cuda", "state": torch.cuda.get_rng_state(device)}
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        return {"type": "xla", "state": xm.get_rng_state(device)}
    return None


def set_device_rng_state(device: torch.device, saved: dict | None) -> None:
    """Restore a state saved on the same device type; another type's is left alone."""
    if saved is None or saved["type"] != device.type:
        return
    if device.type == "cuda":
        torch.cuda.set_rng_state(saved["state"], device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(saved["state"], device)


def sdpa_applies_causal_bias(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA applies torch's lower-right causal bias in place, with no mask in memory:
    on CUDA in bf16 or fp16, where its flash kernel runs it (grouped-query heads included).
    Elsewhere (CPU; CUDA in fp32, whose memory-efficient kernel takes no grouped-query heads)
    the bias is materialised at each call: context parallelism's attention then builds the
    mask once per forward instead. Not yet measured on a GPU."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch onto the device without the host waiting: on GPU through pinned (page-locked)
    host memory, whose copy runs asynchronously on the current stream (the caching host
    allocator keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def mark_step(device: torch.device) -> None:
    """End of a unit of work (an optimizer step, an eval batch): XLA records operations lazily
    and compiles and runs them as one graph here; eager devices have nothing to do."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (on XLA: run the pending graph and wait) so step times are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        mark_step(device)
        xm.wait_device_ops()


class StepClock:
    """Marks the start and end of steps without waiting for the device where it can: CUDA
    events on GPU (read at a logging boundary: the GPU's time between the two marks, idle gaps
    included); the host clock on CPU, whose operations run as they are called; on XLA a mark
    runs the pending graph and waits (its graphs run asynchronously and have no events)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self.device.type == "xla":
            synchronize(self.device)
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start
