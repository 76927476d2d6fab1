"""Expert parallelism (``parallel.expert``): each MoE layer's experts split over the ranks of
the data-parallel axis, tokens exchanged with all-to-all.

transformers 5 keeps a layer's experts as two fused 3-D parameters, ``gate_up_proj [E, 2I, H]``
and ``down_proj [E, H, I]``, in one module whose ``forward(hidden [T, H], top_k_index [T, K],
top_k_weights [T, K])`` runs the kernel that ``config._experts_implementation`` names. Here each
becomes a DTensor ``Shard(0)`` on the ``ep`` axis of the expert mesh (E/ep whole experts per
rank), ``num_experts`` the local count, and the model's experts implementation
``fsdp_lab_ep`` (registered in transformers' ``ExpertsInterface``, its extension point): the
exchange of ``EpForward`` around the kernel the model named before. The router stays dense
(every rank routes its own tokens): routing, and with
it the aux loss, is what it is without EP.

The expert mesh is a view of the same ranks as the data-parallel mesh, ``(efsdp, ep)`` with ep
innermost (torchtitan's and transformers' layout: EP borrows ranks from the shard axis, an
all-to-all group is contiguous ranks); ``engine.fsdp`` shards the experts further on ``efsdp``.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_lab.config import ConfigError
from fsdp_lab.config.topology import EXPERT_AXIS
from fsdp_lab.engine import moe
from fsdp_lab.internals import torch_private, transformers_private

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding a MoE layer's experts as fused 3-D parameters (Qwen3-MoE, Mixtral,
    OLMoE, ...: ``*Experts``), in forward order: those of ``engine.moe``'s MoE blocks that the
    exchange can drive (a ``num_experts`` the kernels read, a 3-D ``down_proj`` too)."""
    return [
        b.experts
        for b in moe.moe_blocks(model)
        if hasattr(b.experts, "num_experts")
        and getattr(getattr(b.experts, "down_proj", None), "ndim", 0) == 3
    ]


def num_experts(model: nn.Module) -> int:
    """Experts per MoE layer (0: a dense model)."""
    counts = {m.gate_up_proj.shape[0] for m in expert_modules(model)}
    if len(counts) > 1:
        raise ConfigError(f"parallel.expert: the MoE layers hold different expert counts {counts}")
    return counts.pop() if counts else 0


def check(model: nn.Module, degree: int) -> None:
    """Refuse, before launch, a model that ``apply`` cannot split ``degree`` ways."""
    experts = expert_modules(model)
    if not experts:
        raise ConfigError(
            f"parallel.expert={degree}: {type(model).__name__} has no mixture-of-experts layers "
            "(experts as fused gate_up_proj/down_proj parameters); use parallel.expert=1"
        )
    extra = sorted({n for m in experts for n, _ in m.named_parameters()} - set(EXPERT_PARAMS))
    if extra:  # GPT-OSS's biases, for one: unverified
        raise ConfigError(
            f"parallel.expert={degree}: {type(experts[0]).__name__} has expert parameters "
            f"{extra} beside {list(EXPERT_PARAMS)}, which expert parallelism does not split; "
            "use parallel.expert=1"
        )
    total = num_experts(model)
    if total % degree:
        raise ConfigError(
            f"parallel.expert={degree} does not divide the model's {total} experts per layer; "
            f"set parallel.expert to a divisor of {total}"
        )


def apply(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Split every MoE layer's experts over ``mesh[ep]`` (on meta: no data moves; materialising
    fills each rank's slice) and route their forward through the all-to-all: the model's
    experts implementation becomes ``fsdp_lab_ep`` (registered in transformers'
    ``ExpertsInterface``), which runs the kernel it named before on the local experts. Returns
    the experts modules, which ``engine.fsdp`` makes FSDP units of their own on ``efsdp``."""
    ep_mesh = mesh[EXPERT_AXIS]
    degree = ep_mesh.size()
    experts = expert_modules(model)
    for module in experts:
        total = module.gate_up_proj.shape[0]
        for name in EXPERT_PARAMS:
            param = getattr(module, name)
            local = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
        # The kernels size their expert loop / histogram by the module's own count.
        module.num_experts = total // degree
        inner = transformers_private.implementation(module.config, "experts")
        _EXCHANGES[module] = EpForward(module, ep_mesh, _kernel(inner, module))
        # The experts read their own config: a copy names the exchange, the model's (and any
        # other module's sharing it) keeps its kernel.
        module.config = transformers_private.with_implementation(
            module.config, "experts", EP_IMPLEMENTATION
        )
    if experts:
        _register()
    return experts


EP_IMPLEMENTATION = "fsdp_lab_ep"
_EXCHANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts -> EpForward


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EP_IMPLEMENTATION, _ep_forward)


def _ep_forward(module: nn.Module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' experts signature: the exchange ``apply`` set up for ``module``."""
    exchange = _EXCHANGES.get(module)
    if exchange is None:
        raise RuntimeError(
            f"{type(module).__name__} runs experts_implementation={EP_IMPLEMENTATION} but was "
            "not split by expert_parallel.apply (a copy of an EP model?)"
        )
    return exchange(hidden_states, top_k_index, top_k_weights)


def _kernel(inner: str | None, module: nn.Module) -> Callable:
    """The experts' kernel the model named before EP (its forward for eager or none)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if inner not in (None, "eager", EP_IMPLEMENTATION) and inner in ALL_EXPERTS_FUNCTIONS:
        return ALL_EXPERTS_FUNCTIONS[inner]
    return inspect.unwrap(type(module).forward)  # the class's own, under transformers' dispatch


@contextlib.contextmanager
def _local_params(module: nn.Module):
    """The kernels index and matmul plain tensors: while one runs, the experts' parameters (FSDP
    hands them over as DTensors on ``ep``) are their local slices, which autograd links back."""
    own = dict(module.named_parameters(recurse=False))
    local = [(module, n, own[n].to_local()) for n in EXPERT_PARAMS if isinstance(own[n], DTensor)]
    with torch_private.lent(local):
        yield


class EpForward:
    """The experts' forward under EP (``fsdp_lab_ep``: transformers' experts interface).

    1. sort this rank's (token, slot) pairs by expert: experts are contiguous per rank, so this
       groups the rows by the rank they go to;
    2. exchange the per-expert counts, and read the split sizes to the host (``.tolist()``: the
       one host sync of the layer; an all-to-all with uneven splits needs them);
    3. exchange the rows (autograd all-to-all: backward sends the gradients back the same way);
    4. run the model's own kernel on the local experts, top-1 with unit weights;
    5. send the outputs back, restore the pairs' order, weight them and sum over the top-k slots
       as the kernels do (same order of operations: EP changes only how GEMM rows are grouped).

    Every rank takes part in every exchange, also with nothing to send or receive: a rank that
    skipped one would hang its peers. A rank that receives no rows still runs its experts on one
    zero-weighted dummy row cut back to none, so backward reaches its expert parameters and their
    FSDP reduce-scatter runs on every rank (transformers' trick).
    """

    def __init__(self, module: nn.Module, ep_mesh: DeviceMesh, kernel: Callable) -> None:
        self.module, self.kernel = module, kernel
        self.group = ep_mesh.get_group()
        self.degree = ep_mesh.size()

    def __call__(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        local, degree, device = self.module.num_experts, self.degree, hidden_states.device
        num_tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        send = hidden_states[order // top_k]
        counts = torch.zeros(local * degree, dtype=torch.long, device=device)
        counts = counts.scatter_add_(0, ids, torch.ones_like(ids)).view(degree, local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_sizes, recv_sizes = torch.stack([counts.sum(1), recv_counts.sum(1)]).tolist()
        recv = torch_private.all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group)
        recv_ids = torch.arange(local, device=device).repeat(degree)
        recv_ids = recv_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes))
        with _local_params(self.module):
            out = self._experts(recv, recv_ids[:, None])
        back = torch_private.all_to_all_single_autograd(out, send_sizes, recv_sizes, self.group)
        pairs = torch.empty_like(back)
        pairs[order] = back
        pairs = pairs.view(num_tokens, top_k, -1)
        return (pairs * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)

    def _experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        if rows.shape[0] == 0:
            dummy = rows.sum(dim=0, keepdim=True)  # zeros, linked to the (empty) receive
            return kernel(self.module, dummy, ids.new_zeros((1, 1)), rows.new_ones((1, 1)))[:0]
        return kernel(self.module, rows, ids, torch.ones_like(ids, dtype=rows.dtype))
