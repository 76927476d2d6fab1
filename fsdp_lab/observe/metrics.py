"""Per-step measurements: step time, throughput, peak memory, all reduced over ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_lab.engine.hardware import devices, memory, process_group
from fsdp_lab.engine.moe import MoeStep, expert_counts


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float  # every position of every row of the global batch (MFU's FLOPs' count)
    trained_tokens: int  # the global batch's targets, the tokens the loss is the mean over
    peak_mem_bytes: int
    peak_mem_bytes_per_rank: list[int]
    skipped: bool = False
    elapsed_s: float = 0.0  # wall time since the loop started, all overheads included
    # Mixtures of experts (None for a dense model, and then left out of the record):
    aux_loss: float | None = None  # the router's load-balancing loss, mean over micro-batches
    expert_load_imbalance: float | None = None  # max over MoE layers of max_e / mean_e tokens
    expert_load_per_layer: list[float] | None = None  # each MoE layer's max_e / mean_e

    def as_record(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k not in MOE_FIELDS}


MOE_FIELDS = frozenset({"aux_loss", "expert_load_imbalance", "expert_load_per_layer"})


@dataclass
class _PendingStep:
    """A step whose numbers are still on the device (or, for the peak and lr, on the host)."""

    step: int
    lr: float
    trained_tokens: int  # the global batch's targets, counted on the host
    loss: torch.Tensor  # this rank's share of the global mean, times dp (see train_step)
    grad_norm: torch.Tensor  # the global norm before clipping
    skipped: torch.Tensor | None  # fp16: the scaler skipped the update
    span: tuple  # the step's start and end marks (devices.StepClock)
    peak_mem_bytes: int  # this rank's allocator / RSS peak so far (a host-side read)
    moe: MoeStep | None = None  # the routers' numbers (the same on every rank)


class StepWindow:
    """The steps since the last logging boundary, read from the device all at once.

    Inside a window nothing waits for the device: losses, gradient norms and skip flags stay
    device tensors, step times are CUDA events on GPU, and ``flush`` reads them with one small
    all-reduce and one copy to the host. Every rank calls ``flush`` at the same steps.
    """

    def __init__(self, device: torch.device, *, tokens_per_step: int) -> None:
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.clock = devices.StepClock(device)
        self._pending: list[_PendingStep] = []
        self._loop_start = time.perf_counter()

    def start_step(self):
        return self.clock.mark()

    def end_step(
        self,
        step: int,
        *,
        start,
        lr: float,
        trained_tokens: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        skipped: torch.Tensor | None,
        moe: MoeStep | None = None,
    ) -> None:
        self._pending.append(
            _PendingStep(
                step=step,
                lr=lr,
                trained_tokens=trained_tokens,
                loss=loss,
                grad_norm=grad_norm,
                skipped=skipped,
                span=(start, self.clock.mark()),
                peak_mem_bytes=memory.peak_memory_bytes(self.device),
                moe=moe,
            )
        )

    def flush(self, *, stop_requested: bool) -> tuple[list[StepMetrics], bool]:
        """Every pending step's metrics (the loss averaged over ranks, each rank's peak) and
        whether any rank asked to stop, in one all-reduce of a (world, 2k+1) table: each rank
        fills its own row (losses, peaks, its stop flag), the sum is everyone's.

        A rank's loss is its summed token losses x dp / the global targets (``train_step``), so
        their mean over the world is the mean over the global batch's trained tokens, however
        unevenly the ranks hold them; a TP group's ranks hold the same value and every group is
        as large, so the mean over all ranks is the mean over data-parallel ranks. A stop
        request (a signal) may reach the ranks at different steps; sharing it here makes every
        rank stop after the same step."""
        pending, self._pending = self._pending, []
        k, world = len(pending), dist.get_world_size()
        where = process_group.collective_device(self.device)
        table = torch.zeros(world, 2 * k + 1, dtype=torch.float64, device=where)
        if k:
            table[dist.get_rank(), :k] = torch.stack([p.loss for p in pending]).to(where)
            table[dist.get_rank(), k : 2 * k] = torch.tensor(
                [float(p.peak_mem_bytes) for p in pending], dtype=torch.float64
            )
        table[dist.get_rank(), 2 * k] = float(stop_requested)
        dist.all_reduce(table)
        same = _same_on_every_rank(pending, where)
        # A mixture of experts' numbers are the global batch's on every rank already.
        moe = [_moe_row(p.moe).to(where) for p in pending if p.moe is not None]
        host = torch.cat([table.flatten(), *same, *moe]).cpu()  # the one read of the window
        now = time.perf_counter() - self._loop_start
        rows = host[: table.numel()].view(world, 2 * k + 1)
        norms = host[table.numel() : table.numel() + k].tolist()
        skipped = host[table.numel() + k : table.numel() + 2 * k].tolist()
        moe_rows = iter(host[table.numel() + 2 * k :].split([m.numel() for m in moe]))
        times = [self.clock.seconds(*p.span) for p in pending]
        out = []
        for i, p in enumerate(pending):
            peaks = [int(v) for v in rows[:, k + i].tolist()]
            later = sum(times[i + 1 :])  # the steps after it in the window
            experts = _moe_fields(next(moe_rows), p.moe) if p.moe is not None else {}
            out.append(
                StepMetrics(
                    step=p.step,
                    loss=rows[:, i].mean().item(),
                    grad_norm=norms[i],
                    lr=p.lr,
                    step_time_s=times[i],
                    tokens_per_s=self.tokens_per_step / times[i],
                    trained_tokens=p.trained_tokens,
                    peak_mem_bytes=max(peaks),
                    peak_mem_bytes_per_rank=peaks,
                    skipped=bool(skipped[i]),
                    elapsed_s=now - later,
                    **experts,
                )
            )
        return out, bool(rows[:, 2 * k].sum().item() > 0)


def _same_on_every_rank(pending: list, where: torch.device) -> list[torch.Tensor]:
    """The window's numbers every rank holds alike (gradient norms, skipped steps), in float64
    on ``where``, for its one host read; none for an empty window."""
    if not pending:
        return []
    zero = torch.zeros((), device=pending[0].loss.device)
    norms = torch.stack([p.grad_norm.float() for p in pending])
    skipped = torch.stack([zero if p.skipped is None else p.skipped.float() for p in pending])
    return [norms.double().to(where), skipped.double().to(where)]


def _moe_row(moe: MoeStep) -> torch.Tensor:
    """[aux | tokens per expert, L x E] in float64, for the window's one host read."""
    return torch.cat([moe.aux_loss.reshape(1), moe.tokens_per_expert.flatten()]).double()


def _moe_fields(row: torch.Tensor, moe: MoeStep) -> dict:
    """The record's MoE numbers: the aux loss and the load imbalance (max_e / mean_e tokens)
    of each layer, the worst layer's as ``expert_load_imbalance``."""
    counts = row[1:].view(moe.tokens_per_expert.shape)
    per_layer = (counts.max(1).values / counts.mean(1).clamp(min=1e-12)).tolist()
    return {
        "aux_loss": float(row[0]),
        "expert_load_imbalance": max(per_layer),
        "expert_load_per_layer": per_layer,
    }


def flops_per_token(model: torch.nn.Module, hf_config, seq_len: int) -> int:
    """Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, appendix B; as in
    torchtitan and nanoGPT). N: parameters that do matmuls (embedding lookups do none, a head
    tied to the input embedding does); L layers, H heads, Q head dim, T sequence length.
    Activation-checkpointing recompute is not counted (MFU, not hardware FLOPs utilisation).
    A frozen parameter (finetune=freeze, lora) costs 4 of the 6: forward and the gradient of
    its input, no weight gradient (counted also below the lowest trainable layer, where
    backward does not reach: an upper bound there). A mixture of experts counts its active
    parameters: the router and top_k of each layer's E experts."""
    embeddings = {
        id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }
    dense = {id(p): p for p in model.parameters() if id(p) not in embeddings}
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in embeddings:
        dense[id(head.weight)] = head.weight
    matmul = sum((6 if p.requires_grad else 4) * p.numel() for p in dense.values())
    # A mixture of experts: a token runs top_k of each layer's E experts (and the router).
    matmul -= 6 * expert_counts(model).inactive_params
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return matmul + 12 * hf_config.num_hidden_layers * heads * head_dim * seq_len


def throughput(
    m: StepMetrics, *, world_size: int, flops_per_token: int, peak_flops: float | None
) -> dict:
    """Per-rank throughput of a step and its model FLOPs utilisation (None without a known
    peak): achieved model FLOP/s per device over the device's peak, counted over every position
    (padding included: the compute done). ``trained_tokens_per_s``: the tokens the loss learns
    (data=chat: the replies), the rate a fine-tuning run makes progress at."""
    per_rank = m.tokens_per_s / world_size
    achieved = per_rank * flops_per_token
    return {
        "trained_tokens_per_s": m.trained_tokens / m.step_time_s if m.step_time_s else 0.0,
        "tokens_per_s_per_rank": per_rank,
        "tflops_per_s_per_rank": achieved / 1e12,
        "mfu": achieved / peak_flops if peak_flops else None,
    }
