"""Micro-benchmarks of one rank's device, run by ``fsdp-lab calibrate`` on every rank at once
(so that ranks sharing cores or a network measure each other's contention): matmul FLOP/s at
given shapes, memory bandwidth, the cost of issuing one operator, collectives' times at given
sizes, and host<->device copies. Each measurement is repeated; the caller gets every repeat's
value (medians and spreads are its business).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_lab.engine.hardware import devices, process_group

MIB = 2**20


def _timed(
    fn: Callable[[], None], device: torch.device, *, inner: int, repeats: int
) -> list[float]:
    """Seconds per call of ``fn``: ``repeats`` timings of ``inner`` calls each, after one
    warm-up round."""
    fn()
    devices.synchronize(device)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        devices.synchronize(device)
        out.append((time.perf_counter() - start) / inner)
    return out


def _inner(seconds_per_call: float, budget_s: float = 0.05) -> int:
    """Calls per timing so that one timing lasts about ``budget_s``."""
    return max(1, min(1000, int(budget_s / max(seconds_per_call, 1e-7))))


def _probe(fn: Callable[[], None], device: torch.device) -> float:
    fn()
    devices.synchronize(device)
    start = time.perf_counter()
    fn()
    devices.synchronize(device)
    return time.perf_counter() - start


def matmul_flops(
    shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, repeats: int
) -> dict[str, list[float]]:
    """FLOP/s of a linear layer's training matmuls at each shape, per repeat; keyed ``MxKxN``:
    M rows of K features through a K -> N weight, forward (M x K by K x N) and backward (the
    input's and the weight's gradients), 6 x M x K x N FLOPs, as a training step runs them."""
    out = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(n, k, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn(m, n, dtype=dtype, device=device)

        def linear(x=x, w=w, grad=grad) -> None:
            x.grad = w.grad = None
            torch.nn.functional.linear(x, w).backward(grad)

        times = _timed(linear, device, inner=_inner(_probe(linear, device)), repeats=repeats)
        out[f"{m}x{k}x{n}"] = [6 * m * k * n / t for t in times]
    return out


def grouped_flops(
    shapes: list[tuple[int, int, int, int]],
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
) -> list[float]:
    """FLOP/s of a mixture of experts' grouped GEMMs at (experts, rows an expert, K, N), per
    repeat: torch's grouped_mm over rows sorted by expert (what transformers' grouped_mm
    experts run), forward and backward, 6 x rows x K x N FLOPs each, over all the shapes."""
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    calls, flops = [], 0.0
    for e, r, k, n in shapes:
        x = torch.randn(e * r, k, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(e, k, n, dtype=dtype, device=device, requires_grad=True)
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=device) * r
        grad = torch.randn(e * r, n, dtype=dtype, device=device)
        calls.append((x, w, offs, grad))
        flops += 6 * e * r * k * n

    def step() -> None:
        for x, w, offs, grad in calls:
            x.grad = w.grad = None
            grouped(x, w, offs=offs).backward(grad)

    times = _timed(step, device, inner=_inner(_probe(step, device)), repeats=repeats)
    return [flops / t for t in times]


def attention_flops(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, repeats: int
) -> list[float]:
    """FLOP/s of causal SDPA forward and backward at (batch, heads, tokens, head dim), per
    repeat, counting half the T x T scores (what a causal kernel computes): 2 x 2 x B x H x
    T^2/2 x D forward, 2.5x that backward."""
    b, h, t, d = shape
    q, k, v = (
        torch.randn(b, h, t, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(b, h, t, d, dtype=dtype, device=device)

    def sdpa() -> None:
        q.grad = k.grad = v.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    times = _timed(sdpa, device, inner=_inner(_probe(sdpa, device)), repeats=repeats)
    flops = 3.5 * 2 * b * h * t * t * d  # (1 + 2.5) x 4 x B x H x (T^2 / 2) x D
    return [flops / t_ for t_ in times]


def memory_bandwidth(device: torch.device, repeats: int, nbytes: int = 64 * MIB) -> list[float]:
    """Bytes/s of an out-of-place add of two fp32 tensors (two read, one written)."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.ones(nbytes // 4, device=device)
    c = torch.empty_like(a)

    def add() -> None:
        torch.add(a, b, out=c)

    times = _timed(add, device, inner=_inner(_probe(add, device)), repeats=repeats)
    return [3 * nbytes / t for t in times]


def op_overhead(device: torch.device, repeats: int, ops: int = 200) -> list[float]:
    """Seconds to issue one small operator under autograd and run its backward: a chain of
    ``ops`` multiplies of a 64-element tensor, forward and backward, per operator."""
    x = torch.ones(64, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    times = _timed(chain, device, inner=2, repeats=repeats)
    return [t / (3 * ops) for t in times]  # a forward op and its backward's two


def collective_times(
    sizes: list[int],
    device: torch.device,
    repeats: int,
    between: tuple[int, int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, dict[int, list[float]]]:
    """Seconds of one all-gather, reduce-scatter and all-reduce over the world, per size (the
    whole tensor's bytes, fp32), per repeat. With ``between`` (M, K, N) each collective follows
    a linear layer's forward at that shape, as a unit's collective follows its compute in a
    step, and only the collective is timed: its time then includes waiting for a rank whose
    compute ran late (on shared cores, not rare). A collective: every rank calls it."""
    world = dist.get_world_size()
    where = process_group.collective_device(device)
    x = w = None
    if between is not None:
        m, k, n = between
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
    out: dict[str, dict[int, list[float]]] = {
        "all_gather": {},
        "reduce_scatter": {},
        "all_reduce": {},
    }
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
            dist.barrier()
            inner = max(2, min(50, int(0.1 / max(_probe(fn, where), 1e-6))))
            # every rank must run as many: take the smallest count any rank chose
            count = torch.tensor([inner], device=where)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            out[name][numel * 4] = [
                _after_compute(fn, x, w, device, int(count.item())) for _ in range(repeats)
            ]
    return out


def _after_compute(fn, x, w, device: torch.device, inner: int) -> float:
    """Seconds per call of ``fn``, each after a linear forward of x by w (none: back to back),
    the collective's own time alone summed."""
    total = 0.0
    for _ in range(inner):
        if x is not None:
            torch.nn.functional.linear(x, w)
        devices.synchronize(device)
        start = time.perf_counter()
        fn()
        devices.synchronize(device)
        total += time.perf_counter() - start
    return total / inner


def optimizer_tensor_times(
    device: torch.device, repeats: int, tensors: int = 32, numel: int = 1024
) -> list[float]:
    """Seconds per parameter tensor of a training step's end: ``clip_grad_norm_`` and a fused
    AdamW step over small DTensors sharded on every rank (their bytes are negligible: what is
    left is each tensor's dispatch, and the norm's one all-reduce shared among them). A
    collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(
            distribute_tensor(torch.zeros(numel, device=device), mesh, [Shard(0)])
        )
        p.grad = distribute_tensor(torch.ones(numel, device=device), mesh, [Shard(0)])
        params.append(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    times = _timed(step, device, inner=5, repeats=repeats)
    return [t / tensors for t in times]


def host_copy_bandwidth(
    device: torch.device, pin: bool, repeats: int, nbytes: int = 64 * MIB
) -> list[float]:
    """Bytes/s of a copy from host memory to the device and back (on a CPU rank: a copy)."""
    host = torch.ones(nbytes // 4)
    if pin:
        host = host.pin_memory()
    on_device = torch.empty(nbytes // 4, device=device)

    def there_and_back() -> None:
        on_device.copy_(host, non_blocking=pin)
        host.copy_(on_device, non_blocking=pin)

    times = _timed(
        there_and_back, device, inner=_inner(_probe(there_and_back, device)), repeats=repeats
    )
    return [2 * nbytes / t for t in times]
