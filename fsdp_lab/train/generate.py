"""Generation on a sharded model: every rank decodes its share of the prompts with a KV cache, in
lockstep with the others.

Each forward of an FSDP2 (or TP, or EP) model is a collective: every rank must run as many of
them, at the same time. So the ranks agree on the number of batches (the most any rank has; a
rank without prompts left runs a one-token placeholder row) and, after each token, on whether any
row of any rank is still going (one all-reduce of a flag): a rank whose rows all ended keeps
stepping with them until the last one does. The model was built with ``use_cache=False`` for
training; generation passes its own ``DynamicCache`` to each forward.

The same loop serves one process without a group (``fsdp-lab eval`` on an export) and
lm-evaluation-harness's ``generate_until`` (``train.harness``).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.engine.hardware import process_group

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled (top_p)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Lockstep:
    """This rank's place among the ranks that split the work: its data-parallel rank and their
    number (a TP group's ranks, and a CP group's, hold the same rank and the same share). Every
    process of the group takes part in ``any`` and ``gather``; without a process group both
    are local."""

    rank: int = 0
    size: int = 1
    device: torch.device = CPU

    def share(self, items: Sequence) -> list:
        """This rank's items: every size-th, from its rank on (a balanced split)."""
        return list(items[self.rank :: self.size])

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process."""
        return self.most(int(flag)) > 0

    def most(self, count: int) -> int:
        """The largest ``count`` of any process."""
        if not dist.is_initialized():
            return count
        value = torch.tensor([count], device=process_group.collective_device(self.device))
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def check_same(self, work: object, what: str) -> None:
        """Every process holds the same ``work`` (compared by a digest of its repr); one that
        differs would score or step apart from the others: fail on all of them."""
        if not dist.is_initialized():
            return
        digest = hashlib.sha256(repr(work).encode()).hexdigest()
        values = process_group.gather_from_processes(digest)
        if len(set(values)) > 1:
            raise RuntimeError(
                f"the ranks hold different {what} ({len(set(values))} versions over "
                f"{len(values)} ranks); every rank must build them alike"
            )

    def gather(self, mine: list[tuple[int, object]]) -> list:
        """Every rank's (index, result) pairs as one list in index order (a TP group's copies
        counted once), on every process."""
        if not dist.is_initialized():
            parts = [mine]
        else:
            parts = process_group.gather_from_processes(mine)
        merged = {index: value for part in parts for index, value in part}
        return [merged[i] for i in sorted(merged)]


@dataclass(frozen=True)
class Request:
    """One prompt to continue: its token ids, and its index (the seed of its sampling)."""

    index: int
    ids: list[int]


StopCheck = Callable[[int, list[int]], bool]  # (request index, tokens so far) -> stop here


@torch.no_grad()
def generate(
    model: nn.Module,
    requests: list[Request],
    sampling: Sampling,
    *,
    lock: Lockstep,
    batch_size: int,
    eos_ids: set[int],
    pad_id: int,
    stop: StopCheck | None = None,
) -> list[list[int]]:
    """The new tokens of each of this rank's ``requests`` (EOS left out): at most
    ``sampling.max_new_tokens``, fewer where EOS or ``stop`` ends one. Every process calls it,
    with its own share (possibly none): the number of forwards is the same on all of them."""
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    try:
        for b in range(lock.most(len(batches))):
            rows = batches[b] if b < len(batches) else []
            out += _generate_batch(
                model, rows, sampling, lock=lock, eos_ids=eos_ids, pad_id=pad_id, stop=stop
            )
    finally:
        model.train(was_training)
    return out


def _generate_batch(
    model: nn.Module,
    rows: list[Request],
    sampling: Sampling,
    *,
    lock: Lockstep,
    eos_ids: set[int],
    pad_id: int,
    stop: StopCheck | None,
) -> list[list[int]]:
    """One batch, left-padded; no rows: a placeholder row that only keeps this rank in step."""
    from transformers import DynamicCache

    placeholder = not rows
    prompts = [r.ids for r in rows] if rows else [[pad_id]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids, mask = ids.to(lock.device), mask.to(lock.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=_config_of(model))
    logits = _forward(model, ids, mask, positions, cache)
    generators = [_generator(sampling, r.index) for r in rows]
    new: list[list[int]] = [[] for _ in prompts]
    done = [placeholder] * len(prompts)
    for t in range(sampling.max_new_tokens):
        chosen = _choose(logits, sampling, generators) if rows else [pad_id]
        for i, token in enumerate(chosen):
            if done[i]:
                continue
            if token in eos_ids:
                done[i] = True
                continue
            new[i].append(token)
            if stop is not None and stop(rows[i].index, new[i]):
                done[i] = True
        if t == sampling.max_new_tokens - 1 or not lock.any(not all(done)):
            break
        step = torch.tensor([[pad_id if d else c] for c, d in zip(chosen, done, strict=True)])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        logits = _forward(model, step.to(lock.device), mask, positions, cache)
    return [] if placeholder else new


def _forward(model, ids, mask, positions, cache) -> torch.Tensor:
    """The last position's logits, in fp32; the cache grows by ``ids``' length."""
    output = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{_cache_keyword(model): cache},
        **_last_logits_only(model),
    )
    return output.logits[:, -1, :].float()


def _last_logits_only(model: nn.Module) -> dict:
    """``logits_to_keep=1`` where the forward takes it (transformers' causal LMs, fsdp_lab's
    fused-loss forward): a prompt's prefill then makes one position's logits, not B x T x V."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _cache_keyword(model: nn.Module) -> str:
    """The decoder's name for the KV cache argument: ``cache`` since transformers 5.2x,
    ``past_key_values`` before (and still accepted there, with a deprecation warning)."""
    base = getattr(model, "base_model", model)
    return (
        "cache"
        if "cache" in inspect.signature(type(base).forward).parameters
        else ("past_key_values")
    )


def _config_of(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _generator(sampling: Sampling, index: int) -> torch.Generator | None:
    """Prompt ``index``'s own random stream (sampling only): its text does not depend on the
    world size, the batch it falls in, or the other prompts."""
    if sampling.temperature == 0:
        return None
    digest = hashlib.sha256(f"{sampling.seed}/{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2**63))


def _choose(
    logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None]
) -> list[int]:
    """Each row's next token: the argmax, or a draw from its top_p nucleus at the temperature."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.cpu() / sampling.temperature, dim=-1)
    chosen = []
    for row, generator in zip(probs, generators, strict=True):
        if sampling.top_p < 1:
            ordered, order = row.sort(descending=True)
            before = ordered.cumsum(0) - ordered  # the mass of the tokens ranked above
            ordered[before >= sampling.top_p] = 0
            row = torch.zeros_like(row).scatter_(0, order, ordered)
        chosen.append(int(torch.multinomial(row, 1, generator=generator)))
    return chosen


def fit_prompt(ids: list[int], max_new_tokens: int, max_positions: int | None) -> list[int]:
    """The prompt's last tokens, as many as leave room for ``max_new_tokens`` within the model's
    positions (lm-eval's HFLM cuts a context the same way)."""
    if max_positions is None:
        return ids
    room = max(max_positions - max_new_tokens, 1)
    return ids[-room:]


def max_positions_of(config) -> int | None:
    """The longest sequence the model's positions allow (None: no limit it states)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
