"""A sharded model's initial weights, filled by every rank into its own shards.

No process holds the whole model: after ``to_empty`` each rank fills only the elements it
stores (a DTensor's local shard, found from its placements).

- **Pretrained** weights are read from the safetensors files one tensor at a time, and of each
  only the rows this rank stores (``safe_open(...).get_slice``: an mmap'd byte range), converted
  to the master dtype as they go. A tensor that transformers builds from several on disk (a
  Mixtral's experts, one file tensor per expert, into one fused ``gate_up_proj``) is built with
  transformers' own conversion (``engine.conversion``) from its sources, then sliced: one
  tensor is the read buffer. A checkpoint whose conversion cannot be planned goes the old way,
  rank 0 reading the whole model and broadcasting it, with a warning saying what it costs.
- **Random init** draws the model one group at a time (each block, then the rest), every rank
  the group's full tensors from a generator seeded by the run's seed and the group's name, each
  keeping its slice. So the same seed gives bitwise the same model at any world size and
  strategy, an unsharded reference (``full_model``) included, at one block of memory.
- **Non-persistent buffers** (rotary ``inv_freq``) are recomputed on every rank by the model's
  own ``_init_weights``: ``to_empty`` leaves garbage in them.
- **LoRA adapters** are initialised as PEFT does (``reset_lora_parameters``), per group, seeded.

The frozen-base fingerprint a fine-tune's checkpoint records is taken from the safetensors
files' own bytes, each file tensor hashed by one rank: the same at any world size, and no rank
reads the base whole.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.config import ConfigError
from fsdp_lab.engine import conversion, finite, nf4, weights
from fsdp_lab.engine.activations import clean_name
from fsdp_lab.engine.conversion import LORA_BASE, NotPerRank, checkpoint_key, owned_tensors
from fsdp_lab.engine.finetune import ADAPTER, blocks
from fsdp_lab.internals import torch_private, transformers_private

log = logging.getLogger(__name__)

_HASH_CHUNK = 64 * 2**20


@dataclass(frozen=True)
class InitialWeights:
    """Where a run's initial weights come from: a pretrained directory, else seeded random."""

    seed: int
    pretrained: str | None = None  # a local directory of safetensors files, or a hub id
    whole: Callable[[], nn.Module] | None = None  # rank 0's whole model: model.loading=rank0,
    per_rank: bool = True  # and the route where a checkpoint cannot be read per rank
    # A pipeline rank's model holds only its stages: the unsplit model on meta, whose groups
    # its seeded draws follow (so each tensor is drawn as unsplit).
    layout: nn.Module | None = None

    def from_files(self) -> bool:
        """Whether the weights are a local directory's files (a hub id's are not)."""

        return self.pretrained is not None and Path(self.pretrained).expanduser().is_dir()


def local_region(t: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor this rank stores: a DTensor's local shard, else all of it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = torch_private.local_shape_and_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _store(target: torch.Tensor, region_value: torch.Tensor) -> None:
    """Copy this rank's part (already sliced) into ``target``'s storage; an NF4 weight's part
    is quantised into it (``nf4.store_nf4``, a collective)."""
    if nf4.is_nf4(target):
        nf4.store_nf4(target, region_value.reshape(_local(target).shape))
        return
    local = _local(target)
    if local.numel():
        with torch.no_grad():
            local.copy_(region_value.to(local.dtype).reshape(local.shape))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(value) -> list:
    _, world = _rank_world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


# -- the model's own tensors ------------------------------------------------------------------


def _init_owner(model: nn.Module) -> dict[int, nn.Module]:
    """Each module's nearest transformers model (itself or an ancestor): whose ``_init_weights``
    initialises it, as transformers' ``smart_apply`` dispatches."""
    from transformers import PreTrainedModel

    owner: dict[int, nn.Module] = {}

    def visit(module: nn.Module, current: nn.Module) -> None:
        current = module if isinstance(module, PreTrainedModel) else current
        owner[id(module)] = current
        for child in module.children():
            visit(child, current)

    visit(model, model)
    return owner


def recompute_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary ``inv_freq``, BERT's ``position_ids``) from the model's
    own init, on every rank. The owning module's parameters, if any, are lent scratch tensors
    so the init cannot touch the real ones."""
    from transformers import initialization

    owner = _init_owner(model)
    with torch.no_grad(), initialization.guard_torch_init_functions():
        for module in model.modules():
            init = transformers_private.init_weights(owner[id(module)])
            if not torch_private.non_persistent_buffers(module) or init is None:
                continue
            scratch = [
                (module, attr, torch.empty(p.shape, dtype=p.dtype))
                for attr, p in module.named_parameters(recurse=False)
            ]
            with torch_private.lent(scratch):
                init(module)


# -- random init, one group at a time ------------------------------------------------------------


def _group_seed(seed: int, group: str) -> int:
    digest = hashlib.sha256(f"{seed}/{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_groups(
    model: nn.Module,
    seed: int,
    *,
    wanted: Callable[[str], bool] = lambda name: True,
    hf_init: bool = True,
    layout: nn.Module | None = None,
) -> None:
    """Draw the ``wanted`` tensors (by clean name) one group at a time: each block of the
    model's stack, then the rest. A group's tensors are lent full-size scratch tensors on the
    host, initialised as transformers does (``_init_weights``, children before parents) when
    ``hf_init``, then the group's LoRA adapters as PEFT does, all under the group's own seed;
    each rank then keeps its slice. ``layout``: the unsplit model on meta, for a model that
    holds some of its tensors (a pipeline stage's): the groups and draws are the layout's, so
    every tensor takes the value it takes unsplit; the ones ``model`` lacks are dropped."""

    shape = model if layout is None else layout
    stack = blocks(shape)
    names = {id(m): n for n, m in shape.named_modules()}
    owner = _init_owner(shape)
    groups = [(clean_name(names[id(b)]), b, frozenset()) for b in stack]
    groups.append(("", shape, frozenset(id(b) for b in stack)))
    targets = {name: t for name, (_, _, t) in owned_tensors(model).items()}
    by_id = {id(t): name for name, (_, _, t) in owned_tensors(shape).items()}
    for group, root, skip in groups:
        order = _children_first(root, skip)
        scratch: dict[int, torch.Tensor] = {}  # id(layout's tensor) -> its scratch
        real: dict[int, torch.Tensor] = {}  # and the model's tensor it fills
        swaps: list[tuple[nn.Module, str, torch.Tensor]] = []
        for module in order:
            for attr, t in torch_private.own_tensors(module, persistent=False):
                name = by_id.get(id(t))
                if name is None or not wanted(name):
                    continue
                if id(t) not in scratch:
                    scratch[id(t)] = torch.empty(t.shape, dtype=t.dtype)
                    if name in targets:
                        real[id(t)] = targets[name]
                swaps.append((module, attr, scratch[id(t)]))
        if not real:  # nothing of this group here (another stage's block)
            continue
        with torch_private.lent(swaps):
            _draw(order, owner, seed, group, hf_init=hf_init, adapter=ADAPTER)
        for key, t in real.items():
            _store(t, scratch[key][local_region(t)])


def _children_first(root: nn.Module, skip: frozenset[int]) -> list[nn.Module]:
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in skip:
            return
        for child in module.children():
            visit(child)
        out.append(module)

    visit(root)
    return out


def _draw(order, owner, seed: int, group: str, *, hf_init: bool, adapter: str) -> None:
    from transformers import initialization

    adapters = {
        id(m)
        for lora in order
        for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
        if isinstance(getattr(lora, part, None), nn.ModuleDict)
        for m in getattr(lora, part).modules()
    }

    with (
        torch.random.fork_rng(devices=[]),
        torch.no_grad(),
        initialization.guard_torch_init_functions(),
    ):
        torch.manual_seed(_group_seed(seed, group))
        if hf_init:  # the base as transformers draws it; the adapters take no draws here
            for module in order:
                init = transformers_private.init_weights(owner[id(module)])
                if init is not None and id(module) not in adapters:
                    init(module)
        torch.manual_seed(_group_seed(seed, group + "/lora"))  # the same on any base
        for module in order:
            reset = getattr(module, "reset_lora_parameters", None)
            if reset is not None and adapter in getattr(module, "lora_A", {}):
                reset(adapter, True)


# -- pretrained weights, read per rank -----------------------------------------------------------


def _planned(model: nn.Module, name_or_path: str, planned=None):
    """(the directory's files, its load plan for ``model``), or ``planned`` where given."""
    if planned is not None:
        return planned

    files = weights.WeightFiles(name_or_path)
    return files, conversion.plan_loading(model, files, name_or_path)


def _source_of(files, source, name: str) -> str:
    """Where a model tensor was read from, in words: its file and tensor, or the files and
    tensors a conversion built it of."""
    where = ", ".join(sorted({str(files.tensors[k].file) for k in source.keys}))
    if len(source.keys) == 1:
        return f"{where}: tensor {source.keys[0]}"
    more = ", ..." if len(source.keys) > 3 else ""
    return f"{where}: one of {', '.join(source.keys[:3])}{more} (converted into {name})"


def read_pretrained(
    model: nn.Module, name_or_path: str, *, seed: int, planned=None, layout=None
) -> None:
    """Fill every parameter and persistent buffer of ``model`` the checkpoint holds with this
    rank's part of it; LoRA adapters (which it does not hold) are drawn as ``init_groups``
    does (``layout``: the unsplit model a pipeline stage's draws follow)."""
    files, plan = _planned(model, name_or_path, planned)
    owned = owned_tensors(model)
    damaged = None
    for name, (_, _, t) in owned.items():
        source = plan.sources.get(name)
        if source is None:
            continue
        value = source.read(files, local_region(t))
        if damaged is None and (bad := finite.count(value)):  # as read: cheap beside the read
            damaged = f"{_source_of(files, source, name)} holds {bad:,} NaN/inf value(s)"
        _store(t, value)
    if (damaged := finite.agree(damaged)) is not None:
        raise ConfigError(f"model.name_or_path={name_or_path}: {damaged}; {finite.DAMAGED}")
    if any(n not in plan.sources for n in owned):  # LoRA adapters: drawn, not read
        init_groups(
            model, seed, wanted=lambda n: n not in plan.sources, hf_init=False, layout=layout
        )


def frozen_fingerprint(model: nn.Module, weights_spec: InitialWeights, planned=None) -> str | None:
    """What a fine-tune's checkpoint records of its frozen base (None: nothing is frozen). Of a
    pretrained base: a digest of the file tensors the frozen parameters are read from, each
    hashed by one rank, so the same at any world size. Of a random one: of the seed and names
    (such a checkpoint holds the whole model anyway)."""
    import xxhash

    frozen = sorted(checkpoint_key(n) for n, p in model.named_parameters() if not p.requires_grad)
    if not frozen:
        return None
    if weights_spec.pretrained is None:
        return "random:" + xxhash.xxh3_128_hexdigest(
            f"{weights_spec.seed}|{'|'.join(frozen)}".encode()
        )
    return files_fingerprint(model, weights_spec.pretrained, frozen, planned)


def gather_whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value, on every rank of its mesh; a plain tensor as it is. A shard
    offloaded to the host joins the gather from the mesh's device (NCCL gathers no host
    tensors)."""
    from torch.distributed.tensor import DTensor

    if nf4.is_nf4(t):  # its values, gathered in the NF4 tensor's dtype
        t = nf4.dequantized(t)
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:
        t = DTensor.from_local(
            local.to(t.device_mesh.device_type),
            t.device_mesh,
            t.placements,
            shape=t.shape,
            stride=t.stride(),
        )
    return t.full_tensor()


FINGERPRINT_KINDS = ("files:", "random:")  # what frozen_fingerprint writes; else: before 11-27


def files_fingerprint(model: nn.Module, name_or_path: str, frozen: list[str], planned=None) -> str:
    import xxhash

    files, plan = _planned(model, name_or_path, planned)
    keys = sorted({k for name in frozen if name in plan.sources for k in plan.sources[name].keys})
    rank, world = _rank_world()
    mine = {k: files.digest(k, chunk=_HASH_CHUNK) for k in keys[rank::world]}
    every: dict[str, str] = {}
    for part in _all_gather(mine):
        every.update(part)
    digest = xxhash.xxh3_128()
    for k in keys:
        digest.update(f"{k}|{every[k]}|".encode())
    return "files:" + digest.hexdigest()


def fill(model: nn.Module, spec: InitialWeights) -> str | None:
    """Give every tensor of ``model`` (after ``to_empty``) its initial value, this rank's part
    only; returns the frozen base's fingerprint (the same on every rank)."""
    planned = None
    if spec.pretrained is not None:  # planned first: NotPerRank before anything is read
        if not spec.from_files():
            raise NotPerRank("not a local directory: download it to read it per rank")
        # planned on the whole model: a pipeline stage's holds a part of the files' tensors
        planned = _planned(spec.layout or model, spec.pretrained)
    recompute_buffers(model)
    if planned is not None:
        read_pretrained(model, spec.pretrained, seed=spec.seed, planned=planned, layout=spec.layout)
    else:
        init_groups(model, spec.seed, layout=spec.layout)
    # of the whole base: a pipeline stage's model holds a part (every rank the same value)
    return frozen_fingerprint(spec.layout or model, spec, planned)


def check_filled(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if param.is_meta:
            raise RuntimeError(f"{name} was not materialised")


__all__ = [
    "LORA_BASE",
    "InitialWeights",
    "NotPerRank",
    "checkpoint_key",
    "fill",
    "frozen_fingerprint",
    "gather_whole",
    "init_groups",
    "local_region",
    "owned_tensors",
    "recompute_buffers",
]
