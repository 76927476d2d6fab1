"""Expert parallelism's all-to-all exchange alone, on 2 gloo ranks: one experts module split
over them against the unsharded module, with experts and a whole rank that receive nothing,
under the grouped_mm and eager kernels: outputs, input gradients and expert gradients."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

E, K = 8, 2


def _exchange_case(rank: int, routing: str, kernel: str) -> dict:
    """This rank's EP outputs and gradients against the unsharded module's, on every rank's
    tokens (each rank makes them all from one seed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeExperts,
        Qwen3MoeTopKRouter,
    )

    from fsdp_lab.engine import expert_parallel

    world, tokens = 2, 6
    config = _config()
    config._experts_implementation = kernel
    torch.manual_seed(0)
    full = Qwen3MoeExperts(config)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.1)
    hidden = torch.randn(world, tokens, config.hidden_size)
    weights = torch.rand(world, tokens, K)
    if routing == "first_rank_only":  # rank 1's experts (4-7) get nothing: an empty receive
        index = torch.stack([torch.randperm(4)[:K] for _ in range(world * tokens)])
    else:  # uneven splits, some experts empty
        index = torch.stack([torch.randperm(4)[:K] * 2 for _ in range(world * tokens)])
    index = index.view(world, tokens, K)
    model = torch.nn.Module()  # a MoE block as engine.moe finds one: a router and the experts
    model.gate = Qwen3MoeTopKRouter(config)
    model.experts = Qwen3MoeExperts(config)
    model.experts.load_state_dict(full.state_dict())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    expert_parallel.apply(model, mesh._unflatten(0, (1, world), ("efsdp", "ep")))
    x = hidden[rank].clone().requires_grad_()
    out = model.experts(x, index[rank], weights[rank])
    out.pow(2).sum().backward()
    want_grads, want_out = [], None
    for r in range(world):
        xr = hidden[r].clone().requires_grad_()
        o = full(xr, index[r], weights[r])
        o.pow(2).sum().backward()
        if r == rank:
            want_out, want_x = o, xr.grad
    local = slice(rank * E // world, (rank + 1) * E // world)
    for name in expert_parallel.EXPERT_PARAMS:
        got = getattr(model.experts, name).grad.to_local()
        want_grads.append((got - getattr(full, name).grad[local]).abs().max().item())
    return {
        "out": (out - want_out).abs().max().item(),
        "x_grad": (x.grad - want_x).abs().max().item(),
        "param_grad": max(want_grads),
        "received": int((index.view(-1, K) // (E // world) == rank).sum()),
    }


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=E)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {
            f"{routing},{kernel}": _exchange_case(rank, routing, kernel)
            for routing in ("first_rank_only", "uneven")
            for kernel in ("grouped_mm", "eager")
        }
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def test_exchange_matches_unsharded_experts_with_empty_experts_and_receives(tmp_path):
    from conftest import check_ok, run_python

    out = tmp_path / "ranks.json"
    check_ok(run_python([__file__, "2", str(out)], timeout=120))
    ranks = [json.loads((tmp_path / f"ranks.json.{r}").read_text()) for r in range(2)]
    assert ranks[1]["first_rank_only,grouped_mm"]["received"] == 0  # the dummy row's case
    for rank in ranks:
        for case, got in rank.items():
            assert got["out"] <= 1e-6 and got["x_grad"] <= 1e-6, (case, got)
            assert got["param_grad"] <= 1e-6, (case, got)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = int(sys.argv[1])
    mp.start_processes(_rank, args=(world, port, sys.argv[2]), nprocs=world, start_method="fork")
