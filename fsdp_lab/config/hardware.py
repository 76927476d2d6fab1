"""The hardware group: which device, how many ranks and nodes, the process group, host
memory, and its single-field rules. Imports no torch."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fsdp_lab.config.device_rows import device_profile
from fsdp_lab.config.errors import ConfigError, positive


class HardwareKind(enum.Enum):
    auto, cpu, gpu, tpu = "auto", "cpu", "gpu", "tpu"


MALLOC_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit


class Backend(enum.Enum):
    """The process group's backend (hardware.backend)."""

    auto = "auto"  # gpu: NCCL for CUDA tensors plus gloo for CPU ones; cpu: gloo
    nccl = "nccl"  # gpu only: the same as auto there
    gloo = "gloo"  # every collective over gloo; on gpu ranks may share a GPU (for testing)


class StartMethod(enum.Enum):
    """How a bare ``python train.py`` starts its local ranks."""

    auto = "auto"  # fork on cpu, spawn on gpu and tpu
    fork = "fork"  # children of the launcher: its imports (torch, transformers) are not redone
    spawn = "spawn"  # fresh interpreters, python -m fsdp_lab.launch.rank_main


@dataclass
class HardwareConfig:
    kind: HardwareKind = HardwareKind.auto
    """cpu (gloo), gpu (nccl, one rank per GPU), tpu (torch_xla SPMD, one process driving every
    XLA device of the host) or auto (gpu when CUDA is available, else cpu)."""
    nproc_per_node: Optional[int] = None
    """Ranks per node. None: 2 on CPU, every visible GPU on gpu, every XLA device on tpu (which
    must use them all); under torchrun/srun what they started (a different value is an error).
    hydra/launcher=slurm: SLURM tasks per node."""
    num_nodes: int = 1
    """Nodes in the job (from the launcher under torchrun/srun; hydra/launcher=slurm asks
    SLURM for this many)."""
    partition: Optional[str] = None
    """hydra/launcher=slurm: the SLURM partition; None: the cluster's default."""
    time_limit_min: int = 60
    """hydra/launcher=slurm: each job's time limit; shortly before it the ranks checkpoint
    and the job requeues itself."""
    backend: Backend = Backend.auto
    """The process group's backend. auto: on gpu NCCL (CUDA tensors) plus gloo (CPU tensors, as
    offload=cpu needs), elsewhere gloo. gloo on gpu: every collective over gloo, and ranks may
    share GPUs (hardware.nproc_per_node above the visible GPUs; rank r on GPU r mod count):
    slow, for checking a sharded layout on one GPU, which NCCL refuses (one rank per GPU).
    Measured on one H100: 2 ranks train and match the unsharded reference to 8.3e-7 in fp32."""
    timeout_s: int = 300
    """Collective timeout: a dead rank fails the run after this long instead of hanging it."""
    flight_recorder: int = 2000
    """torch's flight recorder: the last N collectives of each process group (op, sizes,
    sequence number, the Python stack that issued it), dumped to logs/ when a collective times
    out and read into the error (which rank waits where, which is behind); 0: off. On gloo it
    costs about 1.5 us per collective (torch's own default is the same 2000). Not used on
    tpu, whose collectives XLA runs."""
    threads_per_rank: Optional[int] = None
    """CPU threads per rank. None: the node's cores divided among its ranks."""
    malloc_mmap_threshold: Optional[int] = None
    """Bound each rank's host memory by fixing glibc's M_MMAP_THRESHOLD (bytes, at most 32 MiB;
    Linux): blocks at least this large are mapped on their own and given back to the system
    when freed. None: glibc's own, whose threshold rises to the largest block freed, after
    which tensors come from a heap that fragments. Measured on 2 CPU ranks: RSS then settles at
    about 1.9x the plan (a 72M-parameter Qwen2, 50 steps: 2.26 GB; frozen base: 1.43 GB) and
    creeps up; with 131072 it is flat at the plan plus the process (1.22 and 0.76 GB), but a
    step takes 1.4-1.6x as long (the pages are faulted in again each step). For runs whose
    host RAM is the limit (a big frozen base on many CPU ranks, offload=cpu)."""
    malloc_trim: bool = False
    """CPU ranks: after each optimizer step give glibc's free heap pages back to the system
    (malloc_trim; Linux, a no-op elsewhere), so a rank's RSS settles instead of creeping up as
    the heap fragments. Measured on 2 CPU ranks, a 72M-parameter Qwen2 with a frozen base, 50
    steps: peak RSS 1.13x the plan plus the process, flat (glibc's own: 1.57x and growing), at
    1.08x the step time; with LoRA on it 1.31x at 1.23x. malloc_mmap_threshold=131072 reaches
    0.92-0.94x at 1.4-1.8x. Off by default: it costs step time."""
    start_method: StartMethod = StartMethod.auto
    """How local ranks start. fork (auto on cpu): as children of the launcher, which has already
    imported torch and transformers and checked the model, so a rank starts seconds sooner.
    spawn (auto on gpu and tpu, where CUDA and XLA cannot be used in a forked child): fresh
    interpreters. Not used under torchrun or srun, which start the ranks themselves."""
    peak_tflops: Optional[float] = None
    """One device's peak TFLOP/s at the compute dtype, for MFU. None: known GPUs from a table
    (A100, H100, H200, B200, L4, L40S, A10); CPUs and other devices report no MFU."""
    profile: Optional[str] = None
    """The hardware profile the run's step time is predicted on, to compare with what it
    measures (run.json's ``predicted``, the sweep report): a named device (a100-40gb,
    a100-80gb, h100, h200, b200, cpu) or a file ``fsdp-lab calibrate`` wrote. None: this
    machine's own, measured in a few seconds after the first run on it with these ranks
    (cached in ``profile_cache``; measured again after 30 days or under another torch);
    under torchrun or srun the cached one, or none (``fsdp-lab calibrate`` on a node)."""
    profile_cache: Optional[str] = None
    """Where this machine's measured profiles are kept (one per machine, ranks, dtype and
    torch version), for runs, ``fsdp-lab plan`` and ``tune`` to read. None: ``profiles``
    under fsdp_lab's cache (``$FSDP_LAB_CACHE``, else ``~/.cache/fsdp_lab``)."""


def cache_root() -> Path:
    """Where fsdp_lab keeps what it makes once per machine (tokenized corpora, measured
    profiles, converted models): ``$FSDP_LAB_CACHE``, else ``~/.cache/fsdp_lab``."""
    return Path(os.environ.get("FSDP_LAB_CACHE") or "~/.cache/fsdp_lab").expanduser()


def profile_dir(h: HardwareConfig) -> Path:
    """Where this machine's measured profiles are cached (``profile_cache``)."""
    return Path(h.profile_cache).expanduser() if h.profile_cache else cache_root() / "profiles"


def check_hardware(h: HardwareConfig) -> None:
    if h.nproc_per_node is not None and h.nproc_per_node < 1:
        raise ConfigError(
            f"hardware.nproc_per_node={h.nproc_per_node} must be >= 1; set it to the ranks per node"
        )
    positive(h.num_nodes, "hardware.num_nodes")
    positive(h.timeout_s, "hardware.timeout_s")
    if h.flight_recorder < 0:
        raise ConfigError(f"hardware.flight_recorder={h.flight_recorder} must be >= 0 (0: off)")
    if h.threads_per_rank is not None:
        positive(h.threads_per_rank, "hardware.threads_per_rank")
    limit = MALLOC_MMAP_THRESHOLD_MAX
    if h.malloc_mmap_threshold is not None and not 0 < h.malloc_mmap_threshold <= limit:
        raise ConfigError(
            f"hardware.malloc_mmap_threshold={h.malloc_mmap_threshold} must be 1 to {limit} "
            "bytes (32 MiB, glibc's limit), e.g. 131072; or null for glibc's own"
        )
    if h.peak_tflops is not None:
        positive(h.peak_tflops, "hardware.peak_tflops")
    positive(h.time_limit_min, "hardware.time_limit_min")
    if h.profile:  # a bad name fails here, not after the run it was to price
        device_profile(h.profile, "hardware.profile=")
