"""Non-finite values in weights and optimizer state, found as they are read and agreed on by
every rank, so that a damaged checkpoint is named where it is damaged instead of surfacing
steps later as a non-finite loss blamed on the learning rate.

Each rank checks only what it read (its shards, its slices): one pass over memory already
touched, cheap beside the read itself. One collective then gives every rank the same verdict,
so all ranks fail together with the same line (none waits in a later collective for a rank
that stopped).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def count(t: torch.Tensor) -> int:
    """NaN and inf entries of ``t`` (0 for integer and bool tensors, and for empty ones)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    if local.numel() == 0 or not hasattr(local, "isfinite"):
        return 0
    try:
        return int((~torch.isfinite(local)).sum())
    except (NotImplementedError, RuntimeError):  # a tensor subclass without isfinite (NF4)
        return 0


def agree(found: str | None) -> str | None:
    """Every rank's first finding (``None``: nothing), gathered: the lowest rank's, on every
    rank (a collective where a process group is up; this process's finding alone otherwise)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return next((f for f in every if f is not None), None)


DAMAGED = "the weights are damaged: copy the checkpoint again, or repair that tensor"


def first_in(named) -> str | None:
    """The first of ``(what, tensor)`` pairs (this rank's shards) holding NaN or inf, said in
    words (``what`` names it: "tensor x.weight"); None if all are finite. Lazy pairs are read
    only up to the first damaged one."""
    for what, t in named:
        if bad := count(t):
            return f"{what} holds {bad:,} NaN/inf value(s)"
    return None
