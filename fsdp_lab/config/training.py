"""The groups of the training loop itself: trainer (steps, batches, evaluation), optim, loss
and checkpoint, with their single-field rules. What each loss and checkpoint format needs is
their tables' (``losses``, ``checkpoint_formats``). Imports no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from fsdp_lab.config.errors import ConfigError, positive


class LossKind(enum.Enum):
    """What each loss needs and where it runs is its row in config.losses.LOSSES."""

    auto = "auto"  # a causal LM: liger on GPU where installed, else chunked; otherwise hf
    hf = "hf"  # the model's own: B x T x V logits, upcast to fp32 (masked LM always)
    chunked = "chunked"  # fsdp_lab's linear + cross-entropy chunk by chunk (any device)
    liger = "liger"  # Liger kernel's fused linear cross-entropy (GPU, package liger-kernel)
    cce = "cce"  # Apple's cut cross-entropy (GPU, package cut-cross-entropy)
    z_loss = "z_loss"  # the model's logits: cross-entropy + loss.z_loss_coef x log(Z)^2 (PaLM)


class OptimImpl(enum.Enum):
    auto = "auto"  # fused where the device has the kernel (cpu, gpu), else foreach (tpu)
    fused = "fused"  # one kernel for all parameters (torch's fused AdamW)
    foreach = "foreach"  # multi-tensor ops, a few kernels per parameter group
    for_loop = "for_loop"  # one parameter at a time (the reference implementation)


class CheckpointFormat(enum.Enum):
    sharded = "sharded"  # torch.distributed.checkpoint: every rank writes its own shards
    full = "full"  # one consolidated state dict written by rank 0
    none = "none"


class CheckpointVerify(enum.Enum):
    """What is checked of a checkpoint before any rank loads it."""

    checksum = "checksum"  # every file's size and xxh3-128 digest (reads every byte once)
    size = "size"  # every file is there at its size (a truncated or missing file)
    none = "none"  # only the marker; reading stays safe (no code from a checkpoint, ever)


# "continue" is a keyword, hence the functional form; OmegaConf matches members by name.
OnSaveError = enum.Enum("OnSaveError", [("stop", "stop"), ("continue", "continue")])

OnSaveError.__doc__ = """A checkpoint that cannot be written (too little free space, ENOSPC, EIO):
stop the run (resume=auto continues from the last good one) or continue training without it."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many optimizer steps."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0
    """Max global gradient norm; None disables clipping (the norm is still logged)."""
    implementation: OptimImpl = OptimImpl.auto
    """AdamW's kernels: fused (one kernel; measured 3-4x faster than foreach on CPU), foreach,
    for_loop. auto: fused on cpu and gpu, foreach on tpu (XLA has no fused AdamW) and with the
    fp16 grad scaler (which cannot drive the fused kernel)."""


@dataclass
class LossConfig:
    kind: LossKind = LossKind.auto
    """The cross-entropy over the vocabulary. chunked/liger/cce never build fp32 B x T x V
    logits: they take the final hidden states and the head's weight. auto: for causal LMs whose
    head is a plain linear layer (fused_loss in fsdp_lab.config.families) liger on GPU where
    liger-kernel is installed (pip install 'fsdp_lab[gpu]'), else chunked; hf otherwise."""
    chunk_size: Optional[int] = None
    """chunked: tokens per chunk. None: as many as keep one chunk's fp32 logits within 256 MiB."""
    z_loss_coef: float = 1e-4
    """z_loss: the weight of each learned token's log(Z)^2 (Z: the softmax's normaliser), which
    keeps the logits from drifting large (PaLM's 1e-4). Validation reports the cross-entropy."""


@dataclass
class TrainerConfig:
    max_steps: int = 200
    """Optimizer steps to train."""
    micro_batch_size: int = 4
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step."""
    seq_len: int = 64
    """Tokens per sequence (text data is packed into blocks of this length)."""
    eval_every: int = 50
    """Evaluate validation loss and perplexity before the first step, every N steps and after
    the last; 0: never."""
    eval_batches: int = 4
    """Micro-batches per rank per evaluation (fewer when the validation split is smaller)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0's console (metrics.jsonl is written either way)."""
    log_every: int = 10
    """Steps between reads of the step's numbers from the device. Every step is still recorded;
    in between, nothing waits on the device (no .item(), no synchronisation), so the host runs
    ahead. Evaluations, checkpoints and the last step are boundaries too. A non-finite loss and a
    preemption signal are seen at the next boundary: at most log_every - 1 steps later."""


@dataclass
class CheckpointConfig:
    format: CheckpointFormat = CheckpointFormat.sharded
    """sharded (DCP, reshardable, scales), full (rank 0 writes one file), none."""
    every_n_steps: int = 0
    """Save every N optimizer steps; 0 saves only at the end (and on preemption)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are removed only after a newer one is complete."""
    dir: Optional[str] = None
    """Where checkpoints go; None: <run dir>/checkpoints."""
    async_enabled: bool = False
    """sharded only: write in the background (DCP async_save) while training continues."""
    verify: CheckpointVerify = CheckpointVerify.checksum
    """Before resuming or exporting: checksum (every file's xxh3 digest), size, or none."""
    on_save_error: OnSaveError = OnSaveError.stop
    """A save that cannot fit or fails: stop (the last good checkpoint stays latest) or
    continue training without it."""
    export_hf: bool = False
    """At the end, also write a Hugging Face directory (<run dir>/hf) from the final weights."""


def check_trainer(t: TrainerConfig) -> None:
    for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "seq_len"):
        positive(getattr(t, name), f"trainer.{name}")
    if t.seq_len < 2:
        raise ConfigError(
            f"trainer.seq_len={t.seq_len} must be >= 2 (a next-token target needs two tokens)"
        )
    if t.eval_every < 0:
        raise ConfigError(f"trainer.eval_every={t.eval_every} must be >= 0 (0: no evaluation)")
    positive(t.eval_batches, "trainer.eval_batches")
    positive(t.log_every, "trainer.log_every")


def check_optim(o: OptimConfig, loss: LossConfig) -> None:
    """optim's fields, and loss's."""
    positive(o.lr, "optim.lr")
    positive(o.eps, "optim.eps")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise ConfigError(f"optim.{name}={getattr(o, name)} must be in [0, 1)")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} must be >= 0")
    if o.grad_clip is not None:
        positive(o.grad_clip, "optim.grad_clip")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    if loss.chunk_size is not None:
        positive(loss.chunk_size, "loss.chunk_size")
