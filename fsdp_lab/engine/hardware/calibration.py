"""Micro-benchmarks of one rank's device, run by ``fsdp-lab calibrate`` (and a run's first
prediction on a new machine) on every rank at once, so that ranks sharing cores, memory or a
network measure each other's contention: matrix multiplies and attention at a grid of sizes,
a one-layer decoder at several sizes (the host's cost of an operator, and the other
operators' bandwidth by size), a view's dispatch, an
optimizer step per parameter tensor, FSDP2's hooks around a unit, a tensor-parallel linear's
dispatch, collectives at several sizes, and host<->device copies.

Every figure is a median (a collective's: a mean) over repeated short timings, taken until
its 95% confidence interval is tight or its time budget is spent (``timing``): a busy machine
costs more repeats, and a wider interval stated beside the figure, never a refusal.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_lab.engine import attention as attention_impl
from fsdp_lab.engine.hardware import devices, process_group
from fsdp_lab.engine.hardware.timing import Budget, Timing, mean_interval, time_it, time_together
from fsdp_lab.internals import torch_private, transformers_private


# ---- what is measured -------------------------------------------------------------------------
def matmuls(
    shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, budget: Budget
) -> dict[tuple[int, int, int], tuple[Timing, Timing]]:
    """A linear layer at each (M, K, N): M rows of K features through a K -> N weight, its
    forward alone and forward with backward (the input's and the weight's gradients)."""
    out = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(n, k, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn(m, n, dtype=dtype, device=device)

        def forward(x=x, w=w) -> None:
            with torch.no_grad():
                torch.nn.functional.linear(x, w)

        def both(x=x, w=w, grad=grad) -> None:
            x.grad = w.grad = None
            torch.nn.functional.linear(x, w).backward(grad)

        out[(m, k, n)] = (time_it(forward, device, budget), time_it(both, device, budget))
    return out


def attention(
    shapes: list[tuple[int, int, int, int]],
    dtype: torch.dtype,
    device: torch.device,
    budget: Budget,
) -> dict[tuple[int, int, int, int], tuple[Timing, Timing]]:
    """Causal SDPA at each (batch, heads, tokens, head dim): forward, forward with backward."""
    out = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b, h, t, d in shapes:
        q, k, v = (
            torch.randn(b, h, t, d, dtype=dtype, device=device, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(b, h, t, d, dtype=dtype, device=device)

        def forward(q=q, k=k, v=v) -> None:
            with torch.no_grad():
                sdpa(q, k, v, is_causal=True)

        def both(q=q, k=k, v=v, grad=grad) -> None:
            q.grad = k.grad = v.grad = None
            sdpa(q, k, v, is_causal=True).backward(grad)

        out[(b, h, t, d)] = (time_it(forward, device, budget), time_it(both, device, budget))
    return out


def views(device: torch.device, budget: Budget, count: int = 200) -> Timing:
    """One view's dispatch (``view``, metadata only), per view."""
    x = torch.ones(64, 64, device=device)

    def chain() -> None:
        y = x
        for _ in range(count // 2):
            y = y.view(4096).view(64, 64)

    t = time_it(chain, device, budget)
    return Timing(t.median / count, t.low / count, t.high / count, t.samples)


def decoder(hidden: int, tokens: int, dtype: torch.dtype, device: torch.device | str):
    """A one-layer Llama of ``hidden`` (heads of 32, grouped two to a key-value head, an MLP
    twice as wide) over ``tokens`` tokens, attending as a run's model does (the masks passed
    in, none built): the operators a transformer issues, at a size calibrate chooses.
    Returns the model and its input ids."""
    from transformers import LlamaConfig, LlamaModel

    heads = max(1, hidden // 32)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=64,
        max_position_embeddings=max(64, tokens),
        use_cache=False,
    )
    transformers_private.set_implementation(config, "attn", "sdpa")
    with torch.device(device):
        model = LlamaModel(config).to(dtype)
    attention_impl.install(model)
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    return model, ids


def decoders(
    shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device, budget: Budget
) -> dict[tuple[int, int], Timing]:
    """``decoder``'s forward and backward at each (hidden, tokens): the smallest's kernels are
    negligible beside their dispatch (what one operator costs the host); the larger ones'
    other operators (norms, rotary, activations, copies) less their matmuls and attention
    give those operators' bytes/s at their sizes."""
    out = {}
    for hidden, tokens in shapes:
        model, ids = decoder(hidden, tokens, dtype, device)

        def step(model=model, ids=ids) -> None:
            model.zero_grad(set_to_none=True)
            model(input_ids=ids).last_hidden_state.sum().backward()

        out[(hidden, tokens)] = time_it(step, device, budget)
    return out


def optimizer(device: torch.device, budget: Budget, counts=(8, 64)) -> dict[int, Timing]:
    """A step's end over ``count`` small DTensor parameters sharded on every rank:
    ``clip_grad_norm_`` and a fused AdamW step (their bytes negligible: what is left is each
    tensor's dispatch, and the norm's one all-reduce). A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    out = {}
    for count in counts:
        params = []
        for _ in range(count):
            p = torch.nn.Parameter(
                distribute_tensor(torch.zeros(1024, device=device), mesh, [Shard(0)])
            )
            p.grad = distribute_tensor(torch.ones(1024, device=device), mesh, [Shard(0)])
            params.append(p)
        adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step(params=params, adamw=adamw) -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            adamw.step()

        out[count] = time_together(step, device, budget)
    return out


def _tiny_units(device: torch.device, units: int, width: int = 16) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Linear(width, width, bias=False) for _ in range(units))
    ).to(device)


def fsdp_units(device: torch.device, budget: Budget, units: int = 4) -> tuple[Timing, Timing]:
    """A model of ``units`` tiny linear layers, forward and backward, each layer an FSDP2 unit
    sharded over every rank, and the same model plain: what FSDP2 adds per unit (its hooks,
    copies and collectives, all tiny here). A collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = torch.ones(8, 16, device=device)
    plain = _tiny_units(device, units)

    def run(model) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        return step

    base = time_together(run(plain), device, budget)
    sharded = _tiny_units(device, units)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    return base, time_together(run(sharded), device, budget)


def tp_linears(device: torch.device, budget: Budget) -> tuple[Timing, Timing]:
    """Two tiny linears, colwise then rowwise over a one-rank TP mesh (a TP MLP whose
    collectives have no one to wait for), forward and backward, and the same two plain: what
    a TP linear's DTensor dispatch adds. A collective: every rank builds the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    x = torch.ones(8, 16, device=device)

    def run(model) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        return step

    base = time_it(run(_tiny_units(device, 2)), device, budget)
    tp = _tiny_units(device, 2)
    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    return base, time_it(run(tp), device, budget)


def collectives(
    sizes: list[int], device: torch.device, budget: Budget
) -> dict[str, dict[int, Timing]]:
    """One all-gather, reduce-scatter and all-reduce over the world at each size (the whole
    tensor's bytes, fp32), the ranks started together. A collective: every rank calls it."""
    world = dist.get_world_size()
    where = process_group.collective_device(device)
    out: dict[str, dict[int, Timing]] = {"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}}
    for nbytes in sizes:
        numel = max(world, nbytes // 4 // world * world)
        whole = torch.ones(numel, device=where)
        part = torch.empty(numel // world, device=where)
        ops = {
            "all_gather": lambda w=whole, p=part: process_group.all_gather_single(w, p, None),
            "reduce_scatter": lambda w=whole, p=part: process_group.reduce_scatter_single(
                p, w, None
            ),
            "all_reduce": lambda w=whole: dist.all_reduce(w),
        }
        for name, fn in ops.items():
            out[name][numel * 4] = time_together(fn, device, budget)
    return out


def straggle(
    device: torch.device, budget: Budget, shape: tuple[int, int, int]
) -> tuple[Timing, Timing, Timing]:
    """How long the ranks wait for each other after the same compute: a linear forward at
    ``shape`` on every rank, then a one-element all-reduce, timed apart; and the all-reduce
    alone, back to back. (wait after compute - wait alone) / compute is the share of a unit's
    compute a rank spends waiting for the slowest (on shared cores, not rare). A collective:
    every rank calls it."""
    where = process_group.collective_device(device)
    m, k, n = shape
    x, w = torch.randn(m, k, device=device), torch.randn(n, k, device=device)
    flag = torch.zeros(1, device=where)
    alone = time_together(lambda: dist.all_reduce(flag), device, budget)
    start, computes, waits = time.perf_counter(), [], []
    while True:
        begin = time.perf_counter()
        torch.nn.functional.linear(x, w)
        devices.synchronize(device)
        middle = time.perf_counter()
        dist.all_reduce(flag)
        devices.synchronize(device)
        computes.append(middle - begin)
        waits.append(time.perf_counter() - middle)
        if len(waits) < 3 * budget.min_samples:
            continue
        t = mean_interval(waits)
        over = time.perf_counter() - start > budget.seconds
        more = torch.tensor([float(t.spread > budget.target and not over), float(over)],
                            device=where)  # fmt: skip
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more[0].item() or more[1].item():
            return mean_interval(computes), t, alone


def grouped(
    shapes: list[tuple[int, int, int, int]],
    dtype: torch.dtype,
    device: torch.device,
    budget: Budget,
) -> dict[tuple[int, int, int, int], Timing]:
    """A mixture of experts' grouped GEMMs at (experts, rows an expert, K, N), forward and
    backward: torch's grouped_mm over rows sorted by expert, what transformers' grouped_mm
    experts run."""
    fn_of = torch_private.grouped_mm()
    out = {}
    for e, r, k, n in shapes:
        x = torch.randn(e * r, k, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(e, k, n, dtype=dtype, device=device, requires_grad=True)
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=device) * r
        grad = torch.randn(e * r, n, dtype=dtype, device=device)

        def both(x=x, w=w, offs=offs, grad=grad) -> None:
            x.grad = w.grad = None
            fn_of(x, w, offs=offs).backward(grad)

        out[(e, r, k, n)] = time_it(both, device, budget)
    return out


def host_copies(
    device: torch.device, pin: bool, budget: Budget, nbytes: int = 64 * 2**20
) -> Timing:
    """A copy from host memory to the device and back (on a CPU rank: a copy each way)."""
    host = torch.ones(nbytes // 4)
    if pin:
        host = host.pin_memory()
    on_device = torch.empty(nbytes // 4, device=device)

    def there_and_back() -> None:
        on_device.copy_(host, non_blocking=pin)
        host.copy_(on_device, non_blocking=pin)

    return time_it(there_and_back, device, budget)
