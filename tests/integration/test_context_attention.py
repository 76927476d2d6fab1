"""Context parallelism's attention alone on 2 and 4 gloo ranks against one process's whole
attention, in fp64: outputs and the gradients of Q, K and V (the gathered keys' and values'
come back by reduce-scatter), causal, with packed documents, a sliding window and both, with
grouped-query heads. Measured on torch 2.13 / CPU: within 3e-15."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

CASES = {  # name: the attention's settings, each against one process's masked attention
    "causal": {},
    "documents": {"documents": True},
    "window": {"window": 5},
    "documents+window": {"documents": True, "window": 3},
}


def _reference_attention(q, k, v, documents, window):
    """The whole sequence's attention with the mask spelled out: [B, T, H, D]."""
    t = torch.arange(q.shape[2])
    allowed = t[:, None] >= t[None, :]
    if window is not None:
        allowed = allowed & (t[:, None] - t[None, :] < window)
    mask = allowed[None, None]
    if documents is not None:
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    return out.transpose(1, 2)


def _attention_case(rank: int, world: int, documents: bool = False, window=None) -> dict:
    """This rank's outputs and Q/K/V gradients against the whole attention's, from one seed."""
    import torch.distributed as dist

    from fsdp_lab.data.context import keep_chunks
    from fsdp_lab.engine.context_parallel import ContextAttention, ContextSplit

    torch.manual_seed(0)
    b, h, hkv, t, d = 2, 4, 2, 8 * world, 8  # grouped-query: 2 KV heads
    q, k, v = (torch.randn(b, n, t, d, dtype=torch.float64) for n in (h, hkv, hkv))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    docs = None
    if documents:  # documents crossing chunk boundaries, a different cut on each row
        docs = torch.stack([torch.arange(t) * 3 // t, (torch.arange(t) >= t - 5).long()])
    grad = torch.randn(b, t, h, d, dtype=torch.float64)
    want = _reference_attention(q, k, v, docs, window)
    want.backward(grad)

    def mine(x):  # [B, H, T, D] -> this rank's chunks
        return keep_chunks(x.transpose(1, 2), context=world, rank=rank).transpose(1, 2)

    lq, lk, lv = (mine(x.detach()).clone().requires_grad_() for x in (q, k, v))
    attention = ContextAttention(dist.group.WORLD, world, rank)
    out, _ = attention(
        None, lq, lk, lv, None, scaling=0.3, sliding_window=window, context_split=ContextSplit(docs)
    )
    out.backward(keep_chunks(grad, context=world, rank=rank))
    return {
        "out": (out - keep_chunks(want.detach(), context=world, rank=rank)).abs().max().item(),
        "dq": (lq.grad - mine(q.grad)).abs().max().item(),
        "dk": (lk.grad - mine(k.grad)).abs().max().item(),
        "dv": (lv.grad - mine(v.grad)).abs().max().item(),
    }


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {
            name: _attention_case(rank, world, case.get("documents", False), case.get("window"))
            for name, case in CASES.items()
        }
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


@pytest.mark.parametrize("world", [2, 4])
def test_the_attention_alone_equals_one_process(tmp_path, world):
    """Every case, every rank: the split attention's outputs and gradients are the whole
    sequence's."""
    from conftest import check_ok, run_python

    out = tmp_path / "ranks.json"
    check_ok(run_python([__file__, str(world), str(out)], timeout=180))
    for rank in range(world):
        got = json.loads((tmp_path / f"ranks.json.{rank}").read_text())
        assert set(got) == set(CASES)
        for case, errors in got.items():
            assert max(errors.values()) <= 1e-12, (rank, case, errors)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = int(sys.argv[1])
    mp.start_processes(_rank, args=(world, port, sys.argv[2]), nprocs=world, start_method="fork")
