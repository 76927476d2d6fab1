"""What one micro-batch of a planned run executes, counted by running its forward and backward
on the meta device: every operator torch dispatches, grouped by FSDP unit and pass. The time
model (``plan_time``) prices these counts; nothing here is an assumed constant.

The model is the run's own recipe (``engine.model.model_on_meta``: architecture, finetune's
freezes or adapters) with the run's loss installed (``train.loss.build_loss``), in the compute
dtype, and one micro-batch of the rank's tokens; ``op_count`` counts what it dispatches
(matrix multiplies by shape, other operators by bytes, views, attention and grouped GEMM
calls, and what ``compile=true`` would fuse), and module hooks on the FSDP units say whose
forward or backward an operator belongs to.

Tracing a 32-layer 8B Llama at 8,192 tokens takes about 0.3 s; results are cached per model,
tokens, dtype and loss.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

from omegaconf import OmegaConf

from fsdp_lab.config import Config, ConfigError, LossKind, families
from fsdp_lab.config.losses import loss_of
from fsdp_lab.planning.op_count import BACKWARD, FORWARD, ROOT, PassTrace, _Counter, _Stubs


@dataclass
class StepTrace:
    """A micro-batch's passes by unit (``ROOT``, then the block units' indices in ``units``
    order) and phase."""

    passes: dict[tuple[int, str], PassTrace]
    tokens: int  # positions in the traced micro-batch

    def of(self, unit: int, phase: str) -> PassTrace:
        return self.passes.get((unit, phase)) or PassTrace()


def trace_step(
    cfg: Config, *, batch: int, seq_len: int, loss: str, vocab: int, tp: int = 1
) -> StepTrace:
    """The run's micro-batch of ``batch`` x ``seq_len`` tokens, traced (cached), with the loss
    the plan resolved (``loss``: a ``LossKind`` name; one whose kernels need a GPU is traced
    as the loss its row says the plan counts it as). ``vocab``: the vocabulary the plan
    resolved (the tokenizer is not read again). ``tp``: the layer as one rank of a TP group
    runs it (heads and MLP width split; ``tp_config``)."""

    key = (
        OmegaConf.to_yaml(OmegaConf.structured(cfg.model)),
        OmegaConf.to_yaml(OmegaConf.structured(cfg.finetune)),
        OmegaConf.to_yaml(OmegaConf.structured(cfg.loss)),
        OmegaConf.to_yaml(OmegaConf.structured(cfg.wrap)),
        cfg.precision.param_dtype.name,
        cfg.compile,
        batch,
        seq_len,
        loss,
        vocab,
        tp,
    )
    if key not in _CACHE:
        if len(_CACHE) >= 64:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _trace(cfg, batch, seq_len, loss, vocab, tp)
    return _CACHE[key]


_CACHE: dict[tuple, StepTrace] = {}  # the settings a trace depends on -> the trace


def tp_config(hf_config, tp: int):
    """The config of one TP rank's layer: heads, key-value heads and MLP widths divided by
    ``tp`` with the head size kept (what a rank of a colwise/rowwise split computes; models
    read ``head_dim`` where it is set), or None where its heads do not divide."""

    heads = getattr(hf_config, "num_attention_heads", None)
    if tp == 1:
        return hf_config
    if heads is None or heads % tp:
        return None
    local = copy.deepcopy(hf_config)
    local.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    local.num_attention_heads = heads // tp
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    local.num_key_value_heads = max(1, kv // tp)
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(hf_config, name, None):
            setattr(local, name, max(1, getattr(hf_config, name) // tp))
    return local


def _trace(cfg: Config, batch: int, seq_len: int, loss_name: str, vocab: int, tp: int) -> StepTrace:
    import torch

    from fsdp_lab.engine import moe, wrap
    from fsdp_lab.engine.hardware import devices
    from fsdp_lab.planning.plan_model import trace_hf_config
    from fsdp_lab.train import loss as loss_lib

    hf_config = trace_hf_config(cfg, vocab)
    # experts as grouped GEMMs whatever the run's implementation: their calls are stubbed
    # and priced by plan_time (an eager loop's routing reads its data: not on meta)
    if _is_moe(hf_config):
        moe.set_experts_implementation(hf_config, "grouped_mm")
    local = tp_config(hf_config, tp)
    if local is None:
        raise ConfigError(
            f"parallel.tensor={tp}: {type(hf_config).__name__}'s attention heads do not divide "
            "by it; fsdp-lab plan cannot price one rank's layer"
        )
    kind = LossKind[loss_name]
    if loss_of(kind).triton:  # its kernels need a GPU: the loss the plan counts it as
        kind = loss_of(kind).memory_as or kind
    dtype = devices.TORCH_DTYPES[cfg.precision.param_dtype]
    model, loss = loss_lib.meta_model_with_loss(cfg, local, kind, compute_dtype=dtype)
    model.to(dtype)
    units = wrap.select_units(model, cfg.wrap)
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    step = {"input_ids": ids, "labels": ids}
    counter = _Counter()
    hooks = _attribute(units, counter)
    try:
        with _Stubs(), counter, warnings.catch_warnings():
            # a frozen unit's hook fires on its outputs' gradients alone: what is counted
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            scale = torch.ones((), device="meta")
            counter.phase = FORWARD
            value = loss.train_value(model, step, scale=scale, num_micro=1)
            counter.phase, counter.unit = BACKWARD, ROOT
            value.backward()
    finally:
        for h in hooks:
            h.remove()
    return StepTrace(passes=counter.finish(), tokens=batch * seq_len)


def _is_moe(hf_config) -> bool:

    row = families.family_of(hf_config.model_type)
    return row is not None and row.experts


def _attribute(units, counter) -> list:
    """Hooks that set the counter's unit: a unit's forward between its pre- and post-hooks
    (the root's outside), its backward from its backward pre-hook to the next one's."""
    hooks = []
    for index, unit in enumerate(units):

        def enter(module, args, index=index):
            counter.stack.append(counter.unit)
            counter.unit = index

        def leave(module, args, out):
            counter.unit = counter.stack.pop()

        def backward(module, grad_out, index=index):
            counter.unit = index

        hooks += [
            unit.register_forward_pre_hook(enter),
            unit.register_forward_hook(leave),
            unit.register_full_backward_pre_hook(backward),
        ]
    return hooks
