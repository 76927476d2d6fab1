"""Per-step measurements: step time, throughput, peak memory, all reduced over ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_lab import hardware


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    peak_mem_bytes: int
    peak_mem_bytes_per_rank: list[int]
    skipped: bool = False
    elapsed_s: float = 0.0  # wall time since the loop started, all overheads included

    def as_record(self) -> dict:
        return dict(self.__dict__)


class StepTimer:
    """Wall time of one optimizer step, with the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = 0.0

    def start(self) -> None:
        hardware.synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        hardware.synchronize(self.device)
        return time.perf_counter() - self._start


def gather_step_stats(local_loss: float, device: torch.device, *,
                      stop_requested: bool) -> tuple[float, list[int], bool]:
    """(mean loss over ranks, each rank's peak memory, whether any rank asked to stop) in one
    small all-reduce per step.

    Every rank's micro-batches hold the same number of tokens, so the mean of the ranks' mean
    losses is the mean loss of the global batch. A stop request (a signal) may reach the ranks
    at different steps; sharing it here makes every rank stop after the same step.
    """
    # One-hot rows summed by all-reduce: works on every backend and torch version
    # (all_gather_into_tensor is deprecated in recent releases).
    stats = torch.zeros(dist.get_world_size(), 3, dtype=torch.float64,
                        device=hardware.collective_device(device))
    stats[dist.get_rank()] = torch.tensor(
        [local_loss, float(hardware.peak_memory_bytes(device)), float(stop_requested)],
        dtype=torch.float64)
    dist.all_reduce(stats)
    rows = stats.cpu()
    return (rows[:, 0].mean().item(), [int(v) for v in rows[:, 1].tolist()],
            bool(rows[:, 2].sum().item() > 0))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The model state this rank holds, by what the tensors really occupy: its parameter
    shards, their gradients, and every tensor of the optimizer state (Adam's moments and step).
    Measured after an optimizer step, before zero_grad; ``fsdp-lab plan`` predicts it."""
    params = list(model.parameters())
    return {"params": _nbytes(params),
            "grads": _nbytes(p.grad for p in params if p.grad is not None),
            "optimizer": _nbytes(v for s in optimizer.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor))}


def flops_per_token(model: torch.nn.Module, hf_config, seq_len: int) -> int:
    """Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, appendix B; as in
    torchtitan and nanoGPT). N: parameters that do matmuls (embedding lookups do none, a head
    tied to the input embedding does); L layers, H heads, Q head dim, T sequence length.
    Activation-checkpointing recompute is not counted (MFU, not hardware FLOPs utilisation)."""
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Embedding)}
    params = {id(p): p.numel() for p in model.parameters()}
    dense = sum(n for i, n in params.items() if i not in embeddings)
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in embeddings:
        dense += head.weight.numel()
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 6 * dense + 12 * hf_config.num_hidden_layers * heads * head_dim * seq_len


def throughput(m: StepMetrics, *, world_size: int, flops_per_token: int,
               peak_flops: float | None) -> dict:
    """Per-rank throughput of a step and its model FLOPs utilisation (None without a known
    peak): achieved model FLOP/s per device over the device's peak."""
    per_rank = m.tokens_per_s / world_size
    achieved = per_rank * flops_per_token
    return {"tokens_per_s_per_rank": per_rank, "tflops_per_s_per_rank": achieved / 1e12,
            "mfu": achieved / peak_flops if peak_flops else None}
