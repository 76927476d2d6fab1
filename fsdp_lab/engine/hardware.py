"""The only module that names cuda, xla or cpu: devices, backends, threads, memory and dtypes.

Everything else asks this module, so the GPU path differs from the tested CPU path only here
(and the TPU path here and in ``engine.xla``, the other module that imports torch_xla, only on
hardware=tpu). A test holds the other modules to it (tests/unit/test_layers.py).
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import importlib.metadata
import importlib.util
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.config import (
    Backend,
    ConfigError,
    Dtype,
    ExpertsImplementation,
    HardwareConfig,
    HardwareKind,
)

log = logging.getLogger(__name__)

TORCH_DTYPES = {Dtype.fp32: torch.float32, Dtype.bf16: torch.bfloat16, Dtype.fp16: torch.float16}

# torch_xla pins the torch it was built against; this is the pair the tests run.
XLA_PAIR = ("2.9.0", "2.9.0")  # (torch, torch-xla)
XLA_INSTALL = (
    f"pip install 'fsdp_lab[tpu]' (torch=={XLA_PAIR[0]} with torch-xla=={XLA_PAIR[1]}"
    ", in an environment of its own; see the README)"
)


def resolve_kind(cfg: HardwareConfig) -> HardwareKind:
    """auto becomes gpu when CUDA is usable, else cpu; an explicit gpu without CUDA is an error."""
    match cfg.kind:
        case HardwareKind.auto:
            return HardwareKind.gpu if torch.cuda.is_available() else HardwareKind.cpu
        case HardwareKind.cpu:
            return HardwareKind.cpu
        case HardwareKind.gpu:
            if not torch.cuda.is_available():
                raise ConfigError(
                    "hardware=gpu but CUDA is not available on this machine; use hardware=cpu "
                    "(or hardware=auto)"
                )
            return HardwareKind.gpu
        case HardwareKind.tpu:
            check_xla_env()
            return HardwareKind.tpu
        case _:
            raise ValueError(f"unknown hardware.kind {cfg.kind}")


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


def default_nproc_per_node(kind: HardwareKind) -> int:
    match kind:
        case HardwareKind.gpu:
            return torch.cuda.device_count()
        case HardwareKind.tpu:
            return xla_local_devices()
        case _:
            return 2


def processes_per_node(kind: HardwareKind, nproc_per_node: int) -> int:
    """Processes to start per node: one per rank, except on tpu, where one SPMD process drives
    every device of its host (each device is one data-parallel rank)."""
    return 1 if kind is HardwareKind.tpu else nproc_per_node


def check_nproc(kind: HardwareKind, nproc_per_node: int, chosen: Backend = Backend.auto) -> None:
    """One rank per GPU under NCCL (it refuses two on one device); gloo lets ranks share."""
    gpus = torch.cuda.device_count() if kind is HardwareKind.gpu else 0
    if kind is HardwareKind.gpu and nproc_per_node > gpus and chosen is not Backend.gloo:
        raise ConfigError(
            f"hardware.nproc_per_node={nproc_per_node} but only {gpus} GPUs are visible; lower "
            "hardware.nproc_per_node (one rank per GPU), or set hardware.backend=gloo to share "
            "the GPUs among ranks (slow: for checking a sharded layout)"
        )
    if kind is HardwareKind.tpu and nproc_per_node != xla_local_devices():
        raise ConfigError(
            f"hardware.nproc_per_node={nproc_per_node} but this host has {xla_local_devices()} "
            "XLA devices and SPMD uses all of them; remove hardware.nproc_per_node (with "
            "PJRT_DEVICE=CPU, CPU_NUM_DEVICES sets the count)"
        )


def check_dtype(kind: HardwareKind, dtype: Dtype, setting: str) -> None:
    """Fail before launch when the device cannot compute or reduce in ``dtype``.

    gloo reduces fp16 and bf16 (checked on torch 2.13) and CPU kernels cover both; on GPU,
    bf16 needs an Ampere-or-newer device (NCCL and the matmuls both rely on it).
    """
    if kind is HardwareKind.gpu and dtype is Dtype.bf16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"{setting}=bf16 but this GPU has no bf16 support; use precision=fp16 or fp32"
        )


def check_experts_implementation(kind: HardwareKind, implementation: ExpertsImplementation) -> None:
    """Fail before launch on an experts kernel this device cannot run: ``grouped_mm`` calls
    ``torch.nn.functional.grouped_mm`` (torch >= 2.9; a CPU kernel too), which XLA does not
    lower."""
    if implementation is not ExpertsImplementation.grouped_mm:
        return
    if kind is HardwareKind.tpu or not hasattr(torch.nn.functional, "grouped_mm"):
        where = "hardware=tpu" if kind is HardwareKind.tpu else f"torch {torch.__version__}"
        raise ConfigError(
            f"model.experts_implementation=grouped_mm needs torch.nn.functional.grouped_mm "
            f"(torch >= 2.9, not XLA), which {where} lacks; use eager or batched_mm"
        )


def slow_cpu_dtype(kind: HardwareKind, dtype: Dtype) -> str | None:
    """Why computing in ``dtype`` on this CPU is slow, or None. Without bf16/fp16 instructions
    (AVX512-BF16, AMX; an AVX2 machine has neither) oneDNN falls back to generic kernels:
    measured on a 2-core AVX2 EPYC, a bf16 matmul of 256x49152 by 49152x576 took 40 s, the
    same in fp32 0.5 s, and a SmolLM2-135M step at 2x128 tokens 100 s in bf16."""
    if kind is not HardwareKind.cpu or dtype not in (Dtype.bf16, Dtype.fp16):
        return None
    probe = {Dtype.bf16: "_is_mkldnn_bf16_supported", Dtype.fp16: "_is_mkldnn_fp16_supported"}
    supported = getattr(torch.ops.mkldnn, probe[dtype], None)
    if supported is None or supported():
        return None
    return (
        f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {dtype.value} "
        f"matmuls: {dtype.value} compute runs tens of times slower than fp32 here"
    )


def backend(kind: HardwareKind, chosen: Backend = Backend.auto) -> str:
    """torch's backend string. On GPU, NCCL for CUDA tensors plus gloo for CPU ones: with
    offload=cpu the gradient shards (and so clip_grad_norm_'s all-reduce) live on the CPU, which
    NCCL cannot reduce. ``hardware.backend=gloo`` puts CUDA tensors on gloo too (ranks sharing
    a GPU); nccl anywhere but gpu is refused."""
    if chosen is Backend.nccl and kind is not HardwareKind.gpu:
        raise ConfigError(
            f"hardware.backend=nccl needs hardware=gpu (this run is hardware={kind.value}); "
            "remove hardware.backend (auto: gloo here)"
        )
    if kind is HardwareKind.gpu and chosen is not Backend.gloo:
        return "cuda:nccl,cpu:gloo"
    return "gloo"


def rank_device(kind: HardwareKind, local_rank: int) -> torch.device:
    """One GPU per rank: the local rank's among the visible ones (under srun --gpus-per-task
    each task sees only its own, device 0). On tpu the SPMD device, which stands for all of the
    host's XLA devices: SPMD mode is switched on here, before any XLA tensor exists."""
    if kind is HardwareKind.gpu:
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if kind is HardwareKind.tpu:
        import torch_xla
        import torch_xla.runtime as xr

        xr.use_spmd()
        return torch_xla.device()
    return torch.device("cpu")


def xla_runtime_devices() -> int:
    """Every XLA device the runtime drives (after ``rank_device``)."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def mark_step(device: torch.device) -> None:
    """End of a unit of work (an optimizer step, an eval batch): XLA records operations lazily
    and compiles and runs them as one graph here; eager devices have nothing to do."""
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def collective_device(device: torch.device) -> torch.device:
    """Where small tensors for the process group's collectives live: gloo and NCCL reduce CPU
    and CUDA tensors, not XLA ones (on tpu the process group only joins the host processes)."""
    return torch.device("cpu") if device.type == "xla" else device


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


def set_threads(cfg: HardwareConfig, nproc_per_node: int) -> int:
    """Split the node's cores among its ranks: two threads per rank on two cores is slower."""
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc_per_node)
    torch.set_num_threads(threads)
    return threads


_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def set_host_allocator(cfg: HardwareConfig) -> int | None:
    """Fix glibc's mmap threshold for this process (``hardware.malloc_mmap_threshold``), so
    that a freed tensor's memory goes back to the system instead of staying in a fragmented
    heap. The threshold set, or None: not asked for, or not glibc (macOS, musl), where the
    process's own allocator stays."""
    if cfg.malloc_mmap_threshold is None:
        return None
    libc = _glibc()
    if libc is None or libc.mallopt(_M_MMAP_THRESHOLD, cfg.malloc_mmap_threshold) != 1:
        return None
    return cfg.malloc_mmap_threshold


def trim_host_heap() -> bool:
    """Give glibc's free heap pages back to the system (``malloc_trim(0)``: every arena, the
    pages inside the heap too). False where there is no glibc (macOS, musl)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.cache
def _glibc():
    """glibc, loaded once; None where the C library is another (macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (AttributeError: not glibc)
    except (OSError, AttributeError):
        return None
    return libc


# Older names torch still reads for the same settings: a user's value under either is kept.
_FR_ENV = {
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (),
}


def set_flight_recorder(entries: int, dump_prefix: Path | None) -> None:
    """torch's flight recorder: the last ``entries`` collectives of each process group (0: off),
    read when the group is created. NCCL's watchdog also writes them to ``dump_prefix<rank>``
    on a timeout (gloo has no watchdog: the rank dumps, see ``flight_records``); torch reads that
    name when it dumps. A variable the user set wins."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(entries)}
    if entries and dump_prefix is not None:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(dump_prefix)
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    for name, value in wanted.items():
        if not any(n in os.environ for n in (name, *_FR_ENV[name])):
            os.environ[name] = value


def flight_records() -> list[bytes]:
    """This process's flight recorders now, each collective with its Python stack: pickles of
    plain containers. NCCL keeps a recorder of its own (where CUDA is up), listed first; gloo's
    holds the CPU collectives (all of them on cpu; on gpu those of offloading)."""
    c10d = torch._C._distributed_c10d
    nccl = torch.cuda.is_initialized() and hasattr(c10d, "_dump_nccl_trace")
    return ([c10d._dump_nccl_trace()] if nccl else []) + [c10d._dump_fr_trace()]


def init_process_group(
    kind: HardwareKind, device: torch.device, timeout_s: int, chosen: Backend = Backend.auto
) -> None:
    """Join the group described by the launcher's RANK/WORLD_SIZE/MASTER_* variables."""
    dist.init_process_group(
        backend=backend(kind, chosen),
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if kind is HardwareKind.gpu else None,
    )


# Rank 0 can work alone for longer than the collective timeout (which is there to catch dead
# ranks): reading a large pretrained model, tokenising a corpus. The other ranks wait for it on
# the rendezvous store, whose wait takes a timeout of its own, instead of inside a collective.
SOLO_WORK_TIMEOUT = datetime.timedelta(hours=2)


def gather_from_processes(value) -> list:
    """Every process's ``value`` (any picklable object), in rank order. A collective: every
    process of the group calls it."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def after_rank0(name: str) -> None:
    """Rank 0 calls this when its solo work ``name`` is done; the others block here until then
    (a failed rank 0 ends them anyway: the launcher or torchrun stops the group)."""
    key = f"fsdp_lab/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set(key, "done")
    else:
        store.wait([key], SOLO_WORK_TIMEOUT)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch onto the device without the host waiting: on GPU through pinned (page-locked)
    host memory, whose copy runs asynchronously on the current stream (the caching host
    allocator keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def pin_memory(kind: HardwareKind) -> bool:
    """CPUOffloadPolicy pins host memory for fast H2D copies; pinning needs a GPU."""
    return kind is HardwareKind.gpu


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the allocator's on GPU; on Linux CPUs the process's RSS high-water mark
    (VmHWM), reset through /proc/self/clear_refs, so a step's peak is not the load's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    reset_host_peak()


def reset_host_peak() -> None:
    """Start a new host RSS high-water mark (Linux: VmHWM through /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not permitted: the peak stays the process's lifetime peak
        pass


def host_peak_since_reset_bytes() -> int:
    """The host RSS high-water mark since ``reset_host_peak`` (else the lifetime peak)."""
    return _proc_status_bytes("VmHWM") or host_peak_rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on GPU; on CPU the process's RSS high-water mark since the last reset (it
    includes the interpreter, imports and libraries, about 400 MB). On tpu the host process's
    too: torch_xla 2.9 reports no memory for the SPMD virtual device."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_peak_since_reset_bytes()


def current_memory_bytes(device: torch.device) -> int:
    """Allocated bytes on GPU; on CPU the process's resident set size now."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS") or host_peak_rss_bytes()


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records on this device: the host's operators, and on a GPU its
    kernels and copies (with their streams)."""
    from torch.profiler import ProfilerActivity

    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def start_memory_history(max_entries: int) -> None:
    """GPU: record every allocation and free, with its stack, from now (profile=memory)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_history(pickle_path: Path, html_path: Path | None = None) -> None:
    """GPU: the recorded history as a snapshot (pytorch.org/memory_viz reads it) and, with
    ``html_path``, torch's own HTML view of it (no tool to learn)."""
    torch.cuda.memory._dump_snapshot(str(pickle_path))
    if html_path is not None:
        from torch.cuda import _memory_viz

        html_path.write_text(_memory_viz.trace_plot(torch.cuda.memory._snapshot()))


def stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def on_out_of_memory(callback) -> None:
    """GPU: ``callback()`` when an allocation fails, before the OutOfMemoryError is raised."""
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: callback())


def host_peak_rss_bytes() -> int:
    """This process's lifetime peak resident set size on the host, whatever the device."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _proc_status_bytes(field: str) -> int | None:
    """A kB field of /proc/self/status (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_compile(kind: HardwareKind) -> None:
    """torch.compile's CPU backend (inductor) builds C++; without a compiler it fails late."""
    import shutil

    if kind is HardwareKind.cpu and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError(
            "compile=true on CPU needs a C++ compiler (g++ or clang++) on PATH; "
            "install one or set compile=false"
        )


# Dense peak TFLOP/s per GPU from the vendors' datasheets (no sparsity): bf16/fp16 tensor
# cores, TF32 tensor cores, and fp32 without TF32. Matched in order against
# torch.cuda.get_device_name, so the more specific names come first.
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


def set_tf32(kind: HardwareKind, enabled: bool) -> None:
    """precision.tf32: fp32 matmuls and convolutions on TF32 tensor cores (GPU only)."""
    if kind is HardwareKind.gpu:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def peak_flops(
    cfg: HardwareConfig, kind: HardwareKind, compute: Dtype, *, tf32: bool = False
) -> float | None:
    """Peak FLOP/s of one device for MFU: ``hardware.peak_tflops`` when set, else the table
    above for a known GPU (the TF32 column for fp32 compute with ``tf32``); None (MFU not
    reported) for CPUs and unknown GPUs."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if kind is HardwareKind.tpu:
        return _tpu_peak_flops(compute)
    if kind is not HardwareKind.gpu:
        return None
    name = torch.cuda.get_device_name(0)
    for key, low_precision, tf32_peak, fp32 in PEAK_TFLOPS:
        if key in name:
            if compute is not Dtype.fp32:
                return low_precision * 1e12
            return (tf32_peak if tf32 else fp32) * 1e12
    log.info("no peak FLOP/s known for %s: MFU not reported (set hardware.peak_tflops)", name)
    return None


# Peak bf16 TFLOP/s per TPU chip (one SPMD device each), from the Cloud TPU docs; matched
# against the accelerator type in the TPU VM's metadata (v5litepod-8, v4-32...).
TPU_PEAK_TFLOPS = (
    ("v5litepod", 197.0),
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("v6e", 918.0),
    ("v4", 275.0),
)


def _tpu_peak_flops(compute: Dtype) -> float | None:
    if os.environ.get("PJRT_DEVICE") != "TPU" or compute is not Dtype.bf16:
        return None  # XLA's CPU devices; fp32 matmuls on TPUs run as several bf16 passes
    try:
        from torch_xla._internal import tpu

        accelerator = tpu.get_tpu_type()
    except Exception:  # noqa: BLE001 - no metadata server: no MFU, never a failed run
        return None
    return next((t * 1e12 for key, t in TPU_PEAK_TFLOPS if accelerator.startswith(key)), None)


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


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (on XLA: run the pending graph and wait) so step times are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        mark_step(device)
        xm.wait_device_ops()


def device_summary(kind: HardwareKind) -> str:
    """The device in one line (the launch log and the report); never starts the XLA runtime
    (the launcher calls it too)."""
    if kind is HardwareKind.gpu:
        return f"gpu: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    if kind is HardwareKind.tpu:
        return (
            f"tpu: {xla_local_devices()} XLA devices (PJRT_DEVICE="
            f"{os.environ.get('PJRT_DEVICE')}), torch_xla SPMD"
        )
    return f"cpu: {os.cpu_count()} cores"
