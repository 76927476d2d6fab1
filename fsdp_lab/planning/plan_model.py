"""What ``fsdp-lab plan`` reads off a run's model built on meta (no weights, no device): its
counts, FSDP units, every parameter's shape as a rank holds it before sharding, the layer
shape its activations are counted from, and the loss."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import torch

from fsdp_lab.config import Config, HardwareKind
from fsdp_lab.config.losses import loss_of
from fsdp_lab.config.low_precision import NF4_BITS
from fsdp_lab.config.pipeline import splits_backward
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.engine import activations, conversion, finetune, low_precision, wrap
from fsdp_lab.engine import model as model_lib
from fsdp_lab.engine.model import ModelCounts
from fsdp_lab.engine.moe import moe_blocks
from fsdp_lab.observe import metrics
from fsdp_lab.planning import activation_memory, memory


@dataclass(frozen=True)
class ModelShape(ModelCounts):
    """What the plan needs from the model (``ModelCounts`` and more), read off its meta-device
    build."""

    units: str  # wrap.summarize_units's line
    num_units: int  # the root included
    unit_classes: dict[str, int]
    params: list[memory.ParamShape]  # as a rank holds them before FSDP (TP-split ones: its part)
    layer: activation_memory.LayerShape
    num_checkpointed: int  # decoder layers under activation checkpointing
    last_checkpointed: bool  # the last layer among them (its recomputation adds to the peak)
    vocab_source: str
    loss: str  # the resolved loss.kind
    loss_chunk: int | None  # tokens per chunk of a fused loss; None: the model's own loss
    largest_converted: int = 0  # elements of the largest tensor transformers builds from several
    flops_per_token: int = 0  # training FLOPs per token, MFU's (``observe.metrics``)
    checkpointed_units: frozenset[int] = frozenset()  # the units activation checkpointing wraps
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineShare | None = None  # parallel.pipeline > 1: the heaviest rank's stages


@dataclass(frozen=True)
class PipelineShare:
    """A pipeline rank the plan counts: its stages' layers, and what the schedule keeps in
    flight and sends there."""

    rank: int
    stages: list[int]
    layers: int  # decoder layers it holds
    of_layers: int  # the model's
    bubble: float  # the schedule's idle share (config.pipeline)
    in_flight: float  # of a micro-batch's activations held at the peak, as a fraction
    hidden_bytes: int  # one row's hidden states between stages: seq_len x hidden x dtype bytes
    boundaries: int  # stage boundaries this rank sends or receives across (each way)
    microbatches: int = 1  # each micro-batch cut into these
    head: bool = True  # it runs the last stage (the head and the loss)

    @property
    def note(self) -> str:
        return (
            f"a pipeline: the figures are pipeline rank {self.rank}'s (stages {self.stages}, "
            f"{self.layers} of {self.of_layers} layers), the highest peak; its schedule keeps "
            f"{self.in_flight:.2f} of a micro-batch's activations in flight there, and idles "
            f"{self.bubble:.0%} of a step (the bubble)"
        )

    def step_bytes(self, cfg: Config) -> float:
        """Bytes sent and received in a step: each boundary, forward and backward, every row
        of every micro-batch."""
        rows = cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps
        return 2.0 * self.boundaries * rows * self.hidden_bytes


def _tensor_parallel_shapes(model, parallel) -> dict[int, tuple[int, int, bool]]:
    """What a rank keeps of each TP-split parameter before FSDP shards it on the data-parallel
    ranks: (elements, rows, whether it is a split linear's weight). A colwise layer keeps
    1/tensor of its rows (weight and bias), a rowwise one 1/tensor of its columns (its bias
    stays whole)."""
    if parallel.tensor == 1:
        return {}
    from fsdp_lab.engine import tensor_parallel

    tp, out = parallel.tensor, {}
    for split in tensor_parallel.splits(model, tensor_parallel.check(model, parallel)):
        w, bias = split.module.weight, split.module.bias
        if split.splits_output:
            out[id(w)] = (w.numel() // tp, w.shape[0] // tp, True)
            if bias is not None:
                out[id(bias)] = (bias.numel() // tp, bias.shape[0] // tp, False)
        else:
            out[id(w)] = (w.numel() // tp, w.shape[0], True)
    return out


def _expert_dim1s(model) -> dict[int, tuple[int, ...]]:
    """id(expert parameter) -> the dim-1 sizes of its experts module's parameters (the MoE
    layers' fused experts, which parallel.expert splits)."""

    out = {}
    for block in moe_blocks(model):
        dims = tuple(q.shape[1] for q in block.experts.parameters())
        out.update({id(q): dims for q in block.experts.parameters()})
    return out


def inspect_model(
    cfg: Config, device: HardwareKind, pipeline_rank: int | None = None
) -> ModelShape:
    """Vocabulary, meta model, FSDP units, the owner unit of every parameter, and the loss;
    with ``pipeline_rank``, of what that pipeline rank's stages hold."""
    from fsdp_lab.train import loss as loss_lib

    hf_config, vocab_source = _hf_config(cfg)
    model = model_lib.model_on_meta(hf_config, cfg.model.task, cfg.finetune)
    flops = metrics.flops_per_token(model, hf_config, cfg.trainer.seq_len)  # the whole model's
    share = _pipeline_share(cfg, model, pipeline_rank)  # a pipeline rank's stages
    lowp = low_precision.apply(model, cfg)  # as engine.fsdp converts it, on meta
    loss = loss_lib.resolve_loss(
        cfg.loss,
        hf_config,
        cfg.model.task,
        device,
        compiled=cfg.compile,
        split_backward=splits_backward(cfg.parallel),
    )
    units = wrap.select_units(model, cfg.wrap)
    params, tp_notes = _param_shapes(cfg, model, units)
    layer, notes = _layer_shape(hf_config, cfg, share)
    notes += _counting_notes(cfg, params, lowp, loss)
    loss_row = loss_of(loss)
    layers = finetune.blocks(model)
    layer_ids = {id(m) for m in layers}
    chosen = activations.checkpointed_indices(cfg.activation_checkpointing, len(units))
    if any(id(units[i]) not in layer_ids for i in chosen):
        notes.append(
            "activation checkpointing of units that are not decoder layers is not "
            "modelled (use wrap=transformer for an estimate)"
        )
    return ModelShape(
        **model_lib.count_model(model),
        units=wrap.summarize_units(model, units),
        num_units=len(units) + 1,
        unit_classes=dict(Counter(type(u).__name__ for u in units)),
        params=params,
        layer=layer,
        num_checkpointed=sum(id(units[i]) in layer_ids for i in chosen),
        last_checkpointed=bool(layers) and any(units[i] is layers[-1] for i in chosen),
        vocab_source=vocab_source,
        loss=loss.name,
        loss_chunk=loss_lib.tokens_per_chunk(cfg.loss, layer.vocab) if loss_row.fused else None,
        largest_converted=_largest_converted(model),
        checkpointed_units=frozenset(chosen),
        flops_per_token=flops,
        notes=notes + tp_notes,
        pipeline=share,
    )


def _counting_notes(cfg: Config, params, lowp: dict | None, loss) -> list[str]:
    """How the plan counts a frozen base, low-precision layers and a loss it does not model."""
    notes = []
    if any(not q.trainable for q in params):
        notes.append(
            f"finetune={cfg.finetune.method.name}: activations are counted as for full "
            "training, an upper bound (a frozen linear layer saves no input for backward; LoRA "
            "adds its adapters' small inputs)"
        )
    if lowp is not None:
        notes.append(
            f"{lowp['scheme']}: {lowp['converted']} linear layers ({', '.join(lowp['kinds'])})"
            + (
                f" held in NF4 ({NF4_BITS:.2f} bits a parameter) and gathered as such"
                if lowp["scheme"] == "nf4"
                else " gathered in float8 (1 byte a parameter)"
                if lowp.get("all_gather")
                else " computing in float8, gathered in param_dtype"
            )
        )
    memory_as = loss_of(loss).memory_as
    if memory_as is not None:
        notes.append(
            f"loss={loss.name}: its working memory is estimated as loss={memory_as.name}'s"
        )
    return notes


def _layer_shape(hf_config, cfg: Config, share: PipelineShare | None):
    """The layer model's shape and notes; under a pipeline, of the counted rank's layers."""
    layer, notes = activation_memory.layer_shape(hf_config, cfg.model.task)
    if share is None:
        return layer, notes
    return dataclasses.replace(layer, num_layers=share.layers), [*notes, share.note]


def _pipeline_share(cfg: Config, model, rank: int | None) -> PipelineShare | None:
    """``model`` (meta) cut in place to pipeline rank ``rank``'s stages
    (``engine.pipeline.keep``, as the engine cuts it), and what its schedule keeps in flight;
    None: the whole model."""
    p = cfg.parallel
    if p.pipeline == 1 or rank is None:
        return None
    from fsdp_lab.engine import pipeline

    frozen = any(not q.requires_grad for q in model.parameters())
    stages = pipeline.check(model.config, p, cfg.trainer.micro_batch_size, frozen_base=frozen)
    layers, embed, head = pipeline.rank_layers(stages, rank)
    pipeline.keep(model, layers, embed=embed, head=head)
    mine = stages.stages_of(rank)
    boundaries = sum((s > 0) + (s < stages.stages - 1) for s in mine)
    b = dtype_row(cfg.precision.param_dtype).bytes
    return PipelineShare(
        rank=rank,
        stages=mine,
        layers=len(layers),
        of_layers=model.config.num_hidden_layers,
        bubble=stages.bubble(),
        in_flight=stages.in_flight(rank),
        hidden_bytes=cfg.trainer.seq_len * model.config.hidden_size * b,
        boundaries=boundaries,
        microbatches=stages.microbatches,
        head=head,
    )


def trace_hf_config(cfg: Config, vocab: int | None = None):
    """The run's transformers config, as ``inspect_model`` builds the model from it (with
    ``vocab``, the vocabulary it resolved: the tokenizer not read again)."""
    if vocab is None:
        return _hf_config(cfg)[0]

    preset = cfg.model.arch is not None
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab) if preset else cfg.model
    return model_lib.build_hf_config(model_cfg)


def _hf_config(cfg: Config):
    """The run's transformers config (a preset's vocabulary from the tokenizer, as the launcher
    resolves it), checked as the launcher checks it, and where its vocabulary came from."""
    from fsdp_lab.data import corpus

    tokenizer = corpus.load_tokenizer(cfg)
    model_cfg = model_lib.resolve_vocab_size(cfg.model, tokenizer)
    vocab_source = (
        "model.vocab_size"
        if cfg.model.vocab_size is not None
        else "the model's config"
        if cfg.model.arch is None
        else f"the tokenizer ({type(tokenizer).__name__})"
        if tokenizer is not None
        else "synthetic data (256)"
    )
    hf_config = model_lib.build_hf_config(model_cfg)
    model_lib.check_task(hf_config, cfg.model.task)
    model_lib.check_seq_len(hf_config, cfg.trainer.seq_len)
    if cfg.parallel.context > 1:  # an attention CP reproduces
        from fsdp_lab.engine import context_parallel

        context_parallel.check(hf_config, cfg.parallel.context)
    return hf_config, vocab_source


def _param_shapes(cfg: Config, model, units) -> tuple[list[memory.ParamShape], list[str]]:
    """Every parameter as a rank holds it before FSDP shards it (a TP-split one: its part),
    with the unit that owns it (bottom-up, as ``fsdp.apply_fsdp`` shards them)."""
    owner: dict[int, int] = {}
    for index in reversed(range(len(units))):
        for p in units[index].parameters():
            owner.setdefault(id(p), index)
    split = _tensor_parallel_shapes(model, cfg.parallel)  # id(param) -> (numel, dim0) on tp
    notes = (
        [
            f"parallel.tensor={cfg.parallel.tensor}: model state is exact per rank; a layer's "
            "saved activations are split as TP splits them (attention and MLP; the norms too "
            "with sequence parallelism), the head's and the transients are counted whole"
        ]
        if split
        else []
    )
    experts = _expert_dim1s(model)
    head = getattr(model.get_output_embeddings(), "weight", None)  # a pipeline stage's: none
    tables = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.weight is not head
    }
    params = [
        memory.ParamShape(
            numel=split[id(p)][0] if id(p) in split else p.numel(),
            dim0=split[id(p)][1] if id(p) in split else (p.shape[0] if p.ndim else 1),
            group=owner.get(id(p), -1),
            trainable=p.requires_grad,
            expert_dim1=p.shape[1] if id(p) in experts else 0,
            module_dim1s=experts.get(id(p), ()),
            storage=low_precision.storage(p),
            lookup=id(p) in tables,
            tp_linear=id(p) in split and split[id(p)][2],
        )
        for p in model.parameters()
    ]
    return params, notes


def _largest_converted(model) -> int:
    """Elements of the largest model tensor its checkpoint holds in other tensors (a Mixtral's
    fused experts, one file tensor per expert): read whole on every rank, then sliced."""

    plain = conversion.plain_meta(model)
    sd = plain.state_dict()
    largest = 0
    for keys, save in conversion.plan_saving(plain, sd):
        if list(save({k: sd[k] for k in keys})) != keys:
            largest = max(largest, *(sd[k].numel() for k in keys))
    return largest
