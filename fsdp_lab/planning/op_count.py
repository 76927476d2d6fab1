"""Counting what a model dispatches, on the meta device: every aten operator a forward and
its backward run, into one ``PassTrace`` per unit and pass. A matrix multiply is recorded by
its shape; a view (``view``, ``t``, ``detach``...) moves nothing; any other operator by the
bytes it reads and writes (its tensors' sizes). Scaled-dot-product attention and a mixture
of experts' grouped GEMMs stand in as empty tensors of their outputs' shapes (their kernels
are priced by formula, and grouped routing reads data on a real device). Inductor's fusion
(``compile=true``) is estimated from the same operators (``_Regions``). ``plan_trace`` runs a
planned model's step through it; calibrate counts its own decoder's operators with it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

FORWARD, BACKWARD = "forward", "backward"
# Operators that return a view of their input: metadata only, no kernel reads or writes.
VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "expand",
        "unsqueeze",
        "squeeze",
        "slice",
        "alias",
        "detach",
        "permute",
        "as_strided",
        "select",
        "unbind",
        "split",
        "split_with_sizes",
        "_reshape_alias",
        "reshape",
        "diagonal",
        "view_as_real",
        "view_as_complex",
        "unflatten",
        "flatten",
        "lift_fresh",
    ]
)
# Operators that allocate without writing (their cost is the issue alone).
ALLOCS = frozenset(["empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"])
# A lookup reads the rows it gathers, not its whole table (the embedding's weight).
LOOKUPS = frozenset({"embedding"})
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
ROOT = -1  # the root unit's index (embeddings, final norm, head, loss), as memory.ParamShape


def size_bucket(nbytes: float) -> int:
    """An operator's size class: log2 of its bytes (0 for none), so that a device's
    bandwidth can depend on how much one operator moves (cache-resident or not)."""
    return 0 if nbytes < 1 else int(math.log2(nbytes))


@dataclass
class PassTrace:
    """One unit's forward or backward over one micro-batch, as dispatched."""

    matmuls: Counter = field(default_factory=Counter)  # (batch, M, K, N) -> calls
    grouped: Counter = field(default_factory=Counter)  # (experts, rows, K, N) -> calls
    attention: int = 0  # scaled-dot-product attention calls
    ops: Counter = field(default_factory=Counter)  # size bucket -> operators
    op_bytes: Counter = field(default_factory=Counter)  # size bucket -> bytes read + written
    views: int = 0
    fused_kernels: int = 0  # compile=true: kernels of fused regions
    fused_bytes: float = 0.0  # compile=true: the bytes those kernels read and write
    # every second mm/addmm in dispatch order (what activation_checkpointing=op recomputes)
    second_matmuls: int = 0
    second_flops: float = 0.0
    _plain_matmuls: int = 0  # mm/addmm seen so far (the count the alternation follows)

    def matmul_flops(self) -> float:
        return sum(2 * b * m * k * n * c for (b, m, k, n), c in self.matmuls.items())

    def grouped_flops(self) -> float:
        return sum(2 * r * k * n * c for (_, r, k, n), c in self.grouped.items())


def count_ops(forward) -> tuple[PassTrace, PassTrace]:
    """Every operator ``forward()`` (on meta tensors, returning a scalar) dispatches, and its
    backward's: (forward, backward)."""
    counter = _Counter()
    with _Stubs(), counter:
        value = forward()
        counter.phase = BACKWARD
        value.backward()
    passes = counter.finish()

    def merged(phase: str) -> PassTrace:
        total = PassTrace()
        for (_, ph), p in passes.items():
            if ph != phase:
                continue
            total.matmuls.update(p.matmuls)
            total.grouped.update(p.grouped)
            total.ops.update(p.ops)
            total.op_bytes.update(p.op_bytes)
            total.attention += p.attention
            total.views += p.views
        return total

    return merged(FORWARD), merged(BACKWARD)


def _Stubs():
    """Attention and grouped GEMMs as empty tensors of their outputs' shapes, differentiable,
    recorded by the counter (their kernels are priced by formula)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.shapes = (q.shape, k.shape, v.shape)
            return q.new_empty(*q.shape[:-1], v.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            _Counter.active.record_call("attention", None)
            return tuple(grad.new_empty(s) for s in ctx.shapes)

    class Grouped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.shapes = (x.shape, w.shape)
            return x.new_empty(x.shape[0], w.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            (x, w) = ctx.shapes
            # the input's gradient (rows x N by N x K) and the weight's (K x rows by rows x N)
            _Counter.active.record_call("grouped", (w[0], x[0], w[-1], w[-2]))
            _Counter.active.record_call("grouped", (w[0], x[0], w[-2], w[-1]))
            return grad.new_empty(x), grad.new_empty(w)

    grouped_fns = {getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)} - {None}

    class Stubs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                _Counter.active.record_call("attention", None)
                return Attention.apply(*args[:3])
            if func in grouped_fns:
                x, w = args[0], args[1]
                _Counter.active.record_call(
                    "grouped", (w.shape[0], x.shape[0], w.shape[-2], w.shape[-1])
                )
                return Grouped.apply(x, w)
            return func(*args, **kwargs)

    return Stubs()


class _Counter:
    """The dispatch mode that records each operator into its unit's pass."""

    active: _Counter | None = None

    def __init__(self) -> None:
        from fsdp_lab.internals import torch_private

        outer = self

        class Mode(torch_private.dispatch_mode_base()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.record_op(func.overloadpacket.__name__, args, kwargs or {}, out)
                return out

        self.mode = Mode()
        self.unit, self.phase, self.stack = ROOT, FORWARD, []
        self.passes: dict[tuple[int, str], PassTrace] = {}
        self.regions = _Regions()

    def __enter__(self):
        _Counter.active = self
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        _Counter.active = None

    def current(self) -> PassTrace:
        return self.passes.setdefault((self.unit, self.phase), PassTrace())

    def record_call(self, kind: str, shape) -> None:
        p = self.current()
        if kind == "attention":
            p.attention += 1
        else:
            p.grouped[shape] += 1
        self.regions.boundary()

    def record_op(self, name: str, args, kwargs, out) -> None:
        import torch

        from fsdp_lab.internals.torch_private import tree_leaves

        p = self.current()
        name = name.removesuffix("_")  # an in-place variant (addmm_) is its operator's kind
        if name in VIEWS:
            p.views += 1
            self.regions.alias(out, args)
            return
        if name in ALLOCS:
            p.views += 1
            return
        if name in MATMULS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            self.regions.matmul_reads((a, b))
            if a.dim() == 3:
                p.matmuls[(a.shape[0], a.shape[1], a.shape[2], b.shape[2])] += 1
            else:
                p.matmuls[(1, a.shape[0], a.shape[1], b.shape[1])] += 1
                p._plain_matmuls += 1
                if p._plain_matmuls % 2 == 0:
                    p.second_matmuls += 1
                    p.second_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.regions.boundary()
            return
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in LOOKUPS:
            ins = ins[1:]  # the indices; the rows read are the output's size again
            outs = outs * 2
        nbytes = sum(_nbytes(t) for t in ins + outs)
        bucket = size_bucket(nbytes)
        p.ops[bucket] += 1
        p.op_bytes[bucket] += nbytes
        self.regions.op((self.unit, self.phase), ins, outs)

    def finish(self) -> dict[tuple[int, str], PassTrace]:
        for key, (kernels, nbytes) in self.regions.finish().items():
            p = self.passes.setdefault(key, PassTrace())
            p.fused_kernels, p.fused_bytes = kernels, nbytes
        return self.passes


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


class _Regions:
    """Inductor's fusion, estimated: consecutive non-matmul operators of one pass form a
    region, one kernel; a region reads each tensor it did not produce once and writes each
    tensor it produced that something outside it reads (a later operator, or backward)."""

    def __init__(self) -> None:
        self.region = 0
        self.key_of: dict[int, tuple] = {}  # region -> its pass
        self.made: dict[int, tuple[int, int, object]] = {}  # storage -> (region, bytes, ref)
        self.reads: dict[int, set[int]] = {}  # region -> storages read from outside it
        self.read_bytes: Counter = Counter()
        self.written: set[int] = set()  # storages read outside the region that made them
        self.open = False

    def boundary(self) -> None:
        """A matmul or an attention call: the running region ends (the kernel reads its inputs
        itself: an input made by a region is written by it)."""
        self.open = False

    def _storage(self, t):
        from fsdp_lab.internals import torch_private

        return torch_private.storage_key(t)

    def alias(self, out, args) -> None:
        """A view: nothing moves."""

    def op(self, key: tuple, ins, outs) -> None:
        if not self.open:
            self.region += 1
            self.open = True
            self.key_of[self.region] = key
        r = self.region
        seen = self.reads.setdefault(r, set())
        for t in ins:
            sid, _ = self._storage(t)
            made = self.made.get(sid)
            if made is not None and made[0] == r:
                continue
            if sid not in seen:
                seen.add(sid)
                self.read_bytes[r] += _nbytes(t)
            if made is not None:
                self.written.add(sid)
        for t in outs:
            sid, storage = self._storage(t)
            if sid not in self.made or self.made[sid][0] != r:
                self.made[sid] = (r, _nbytes(t), storage)

    def matmul_reads(self, ins) -> None:
        for t in ins:
            sid, _ = self._storage(t)
            if sid in self.made:
                self.written.add(sid)

    def finish(self) -> dict[tuple, tuple[int, float]]:
        out: dict[tuple, list] = {}
        for r, key in self.key_of.items():
            entry = out.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += self.read_bytes[r]
        for sid, (r, nbytes, _) in self.made.items():
            if sid in self.written and r in self.key_of:
                out[self.key_of[r]][1] += nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}
