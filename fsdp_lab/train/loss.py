"""The training loss: cross-entropy over the vocabulary without fp32 B x T x V logits.

A causal LM's own loss (transformers' ``ForCausalLMLoss``) takes ``lm_head(hidden)``, B x T x V
logits in the compute dtype, and upcasts them to fp32 before the cross-entropy. At SmolLM2's
49k vocabulary and 8 x 1024 tokens that is 0.8 GB of bf16 logits, 1.6 GB of fp32 ones and as
much again for their gradient: most of a small model's step memory, and passes over it that
cost time. The fused kinds take the final hidden states and the head's weight instead:

| loss.kind | what computes it                                             | where       |
| --------- | ------------------------------------------------------------ | ----------- |
| hf        | the model's logits, a cross-entropy sum as its own loss's    | everywhere  |
| chunked   | ``train.linear_ce``, a chunk of tokens at a time             | everywhere  |
| liger     | liger-kernel's ``LigerFusedLinearCrossEntropyFunction``      | GPU         |
| cce       | cut-cross-entropy's ``linear_cross_entropy`` (exact, no filter) | GPU      |

``model_mixin`` gives the class a fused loss's model is built as (``engine.model``'s ``mixin``):
a subclass of the causal LM's own class whose head is a ``FusedLossHead`` and whose forward
computes the loss from the hidden states as the head's own forward (transformers is extended
from construction, never patched): FSDP2's hooks on whichever module owns the head (the root, or
a unit of its own with wrap=size) gather its weight for the loss and reduce its gradient after.
Only model types whose own forward is exactly ``lm_head(base(...))`` followed by
``ForCausalLMLoss`` get it (``config.families``' fused_loss column: no logit scaling, soft-
capping or bias; each is compared with its own loss in ``tests``).

What each loss needs and where it runs is its row in ``config.losses``; its code is its entry
in ``FUSED_LOSSES`` below.

Every kind gives the training step the SUM of a micro-batch's token losses, never its mean: the
step divides all ranks' micro-batches once by the global batch's count of targets, so the loss
is the mean over the batch's trained tokens however unevenly ranks and micro-batches hold them
(chat data, where only answers are labels; a masked LM's masked share). Packed rows
(``position_ids`` restarting at each sequence, with the loader's ``sequence_index``) attend
within their sequence, without a host sync: ``engine.attention``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_lab.config import (
    Config,
    ConfigError,
    HardwareKind,
    LossConfig,
    LossKind,
    ModelTask,
    families,
)
from fsdp_lab.config.hardware_kinds import Feature, hardware_row
from fsdp_lab.config.losses import loss_of
from fsdp_lab.config.model import task_row
from fsdp_lab.data.context import CONTEXT_DOCUMENTS
from fsdp_lab.data.labels import IGNORE_INDEX, shifted_targets
from fsdp_lab.engine import attention
from fsdp_lab.engine import model as model_lib
from fsdp_lab.engine.context_parallel import ContextSplit
from fsdp_lab.train.loss_code import (  # noqa: F401 - each loss's code, read through here
    FUSED_LOSSES,
    LOGIT_LOSSES,
    FusedLossHead,
    FusedLossLM,
    FusedLossSpec,
    fused_mixin,
)
from fsdp_lab.train.moe_loss import RouterAux, build_router_aux

log = logging.getLogger(__name__)

CHUNK_LOGITS_BYTES = 256 * 2**20  # the default chunk's fp32 logits


def resolve_loss(
    cfg: LossConfig,
    hf_config,
    task: ModelTask,
    device: HardwareKind,
    *,
    compiled: bool,
    split_backward: bool = False,
) -> LossKind:
    """The loss a run computes: ``cfg.kind``, with auto decided from the model and device.
    A loss the model or device cannot take (its row in ``config.losses``) is a ConfigError
    naming the fix (the rules, ``config.rules.refuse_for_hardware``, refused first what the
    device's row refuses: a loss other than the model's own, Triton kernels)."""
    row = families.family_of(hf_config.model_type)
    fits = task_row(task).causal and row is not None and row.fused_loss
    if cfg.kind is LossKind.auto:
        hardware = hardware_row(device)
        # split_backward: a zero-bubble pipeline runs each backward in halves, which a fused
        # loss's own backward cannot (the rules refuse one set explicitly)
        if not fits or not hardware.runs(Feature.custom_loss) or split_backward:
            return LossKind.hf
        # Compiled runs chunked, eager GPU runs liger: liger's kernel is the faster alone,
        # compiled chunked the faster in whole steps (liger's small chunks cost host time);
        # the H100 figures are in docs/benchmarks.md ("The loss").
        liger = loss_of(LossKind.liger).package
        if (
            hardware.runs(Feature.triton)
            and not compiled
            and importlib.util.find_spec(liger.module) is not None
        ):
            return LossKind.liger
        return LossKind.chunked
    row = loss_of(cfg.kind)
    if row.fused and not fits:
        what = (
            "a masked LM"
            if task_row(task).masks_tokens
            else f"model_type={hf_config.model_type}, whose head is not known to be a plain "
            f"linear layer (fused: {', '.join(families.fused_loss_types())})"
        )
        raise ConfigError(
            f"loss={cfg.kind.name} takes a causal LM's hidden states and head; "
            f"this is {what}; use loss=hf (or loss=auto)"
        )
    refused = hardware_row(device).refuses.get(Feature.triton)
    if row.triton and refused:
        raise ConfigError(f"hardware={device.name} cannot run loss={cfg.kind.name}: {refused}")
    if row.package is not None and importlib.util.find_spec(row.package.module) is None:
        pip = row.package.pip
        raise ConfigError(
            f"loss={cfg.kind.name} needs the package {pip}, which is not "
            f"installed: pip install {pip}, or use loss=chunked"
        )
    return cfg.kind


def model_mixin(cfg: LossConfig, kind: LossKind, hf_config, *, compiled: bool) -> type | None:
    """The mixin the model is built with for ``kind`` (``engine.model.model_on_meta``'s
    ``mixin``): a fused loss's, or None for a loss on the model's own logits."""
    if not loss_of(kind).fused:
        return None
    chunk = tokens_per_chunk(cfg, hf_config.vocab_size)
    return fused_mixin(FusedLossSpec(kind, chunk, compiled))


def tokens_per_chunk(cfg: LossConfig, vocab_size: int) -> int:
    """Tokens per chunk of a fused loss: as set, else the largest power of two whose chunk's
    fp32 logits fit in 256 MiB (2048 at a 32k vocabulary). A power of two divides the usual
    batch x sequence, so no ragged last chunk recompiles the compiled chunk step."""
    if cfg.chunk_size:
        return cfg.chunk_size
    rows = max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))
    return 1 << (rows.bit_length() - 1)


@dataclass(frozen=True)
class Loss:
    """What the loop asks of the loss: the summed token losses of a micro-batch (training: the
    step divides every micro-batch of every rank by the global batch's count of targets once),
    and those sums with their count (evaluation: a mean over every token of every rank)."""

    kind: LossKind  # resolved: a row of config.losses
    causal: bool
    config: LossConfig = dataclasses.field(default_factory=LossConfig)  # the loss group
    router: RouterAux | None = None  # a mixture of experts' load-balancing loss
    # Sequences split over a CP group (parallel.context > 1): the loader shifted the labels
    # before the split, and each forward tells the attention (engine.context_parallel).
    sequences_split: bool = False
    compute_dtype: torch.dtype = torch.float32  # what an eager attention's additive mask is in

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """What each position learns: a causal LM's next token (already, for a split), a
        masked LM's label."""
        return shifted_targets(labels) if self.causal and not self.sequences_split else labels

    def target_count(self, labels: torch.Tensor) -> torch.Tensor:
        """The positions of a batch that are trained on, on the device."""
        return (self.targets(labels) != IGNORE_INDEX).sum()

    def _inputs(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        """The model's keyword arguments of a batch, ``labels`` popped by the caller: the
        attention mask made here (``engine.attention``: packed rows, ``position_ids`` with the
        loader's ``sequence_index``, within their sequence; no host sync to find them); a
        context-parallel split's documents become the attention's ``context_split``."""
        inputs = dict(batch)
        index = inputs.pop("sequence_index", None)
        if attention.base_of(model) is not None:
            inputs["attention_mask"] = attention.training_mask(
                model,
                inputs["input_ids"],
                sequence_index=index,
                position_ids=inputs.get("position_ids"),
                dtype=self.compute_dtype,
            )
        if self.sequences_split:
            documents = inputs.pop(CONTEXT_DOCUMENTS, None)
            inputs["context_split"] = ContextSplit(documents)
        return inputs

    def _fused(self, model: nn.Module, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
        """A fused loss's sum of the token losses (the model's head computes it)."""
        shifted = {"labels_shifted": True} if self.sequences_split else {}
        return model(**inputs, labels=labels, loss_reduction="sum", **shifted).loss

    def train_value(
        self, model: nn.Module, batch: dict[str, torch.Tensor], *, scale, num_micro: int
    ) -> torch.Tensor:
        """A micro-batch's share of the step's objective: its summed token losses x ``scale``
        (dp / the global targets), plus, for a mixture of experts, the router's global aux
        loss x its coefficient / ``num_micro`` (the step's mean over micro-batches; the same on
        every rank, so FSDP's average over dp keeps it once)."""
        if self.router is None:
            return self(model, batch) * scale
        with self.router.recording():
            value = self(model, batch) * scale
        mask = self.targets(batch["labels"]) != IGNORE_INDEX
        return value + self.router.loss(mask) / num_micro

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sum of the batch's token losses (fp32 scalar on the device): a fused loss's
        reduction="sum"; a logit loss (``LOGIT_LOSSES``: hf, z_loss) from the model's logits,
        computed as the model's own loss computes its mean (a causal LM's logits upcast to fp32
        first, a masked LM's in their dtype, as BERT's: the same memory as
        ``model(**batch).loss``)."""
        return self.stage_value(model, batch, inputs_embeds=None, last=True)

    def stage_value(
        self,
        model: nn.Module,
        batch: dict[str, torch.Tensor],
        *,
        inputs_embeds: torch.Tensor | None,
        last: bool,
    ) -> torch.Tensor:
        """One pipeline stage's forward (``engine.pipeline.Stage``): the model's own, from the
        previous stage's hidden states as ``inputs_embeds`` where given. A stage before the
        last returns its hidden states (its head is the identity); the last, the summed token
        losses, as ``__call__``."""
        inputs = self._inputs(model, batch)
        labels = inputs.pop("labels")
        if inputs_embeds is not None:
            del inputs["input_ids"]
            inputs["inputs_embeds"] = inputs_embeds
        if not last:  # the decoder's output itself (a zero-bubble schedule detaches it in place)
            return model.base_model(**inputs).last_hidden_state
        if loss_of(self.kind).fused:
            return self._fused(model, inputs, labels).float()
        logits = model(**inputs).logits
        return self._logit_sum(logits.float() if self.causal else logits, labels, self.kind)

    def _logit_sum(
        self, logits: torch.Tensor, labels: torch.Tensor, kind: LossKind = LossKind.hf
    ) -> torch.Tensor:
        targets = self.targets(labels)
        compute = LOGIT_LOSSES[kind]
        return compute(logits.flatten(0, 1), targets.flatten(), cfg=self.config).float()

    def token_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(sum of token losses, tokens counted) in float64, on the batch's device; the logits
        in fp32 (no gradient is kept)."""
        labels = batch["labels"]
        count = self.target_count(labels)
        inputs = self._inputs(model, batch)
        inputs.pop("labels")
        if loss_of(self.kind).fused:
            total = self._fused(model, inputs, labels)
        else:
            # the cross-entropy whatever the objective (z_loss's term is not a validation loss)
            total = self._logit_sum(model(**inputs).logits.float(), labels)
        return torch.stack([total.double(), count.double()])


def meta_model_with_loss(
    cfg: Config,
    hf_config,
    kind: LossKind,
    *,
    compiled: bool | None = None,
    tp_ranks: int = 1,
    sequences_split: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, Loss]:
    """A run's model on meta (``engine.model.model_on_meta``: its finetune applied), built for
    ``kind``'s loss (``resolve_loss``'s, or the one the plan prices), and that loss: the
    worker's recipe, which the plan's trace, calibrate's loop and the tests follow.
    ``compiled``: else ``cfg.compile``."""
    compiled = cfg.compile if compiled is None else compiled
    task = cfg.model.task
    mixin = model_mixin(cfg.loss, kind, hf_config, compiled=compiled)
    model = model_lib.model_on_meta(hf_config, task, cfg.finetune, mixin)
    loss = build_loss(
        cfg.loss,
        model,
        kind=kind,
        task=task,
        tp_ranks=tp_ranks,
        sequences_split=sequences_split,
        compute_dtype=compute_dtype,
    )
    return model, loss


def build_loss(
    cfg: LossConfig,
    model: nn.Module,
    *,
    kind: LossKind,
    task: ModelTask,
    tp_ranks: int = 1,
    sequences_split: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> Loss:
    """``kind``'s loss (resolved by ``resolve_loss``) on the meta model, before sharding: a
    fused loss's model was built for it (``model_mixin``); a causal LM's attention takes the
    masks the loss makes (``engine.attention``); a
    mixture of experts' routers get the hooks of its aux loss (``tp_ranks``: ranks that hold
    the same rows, a TP group; a CP group's hold different tokens of them and are counted
    each). ``sequences_split``: the batches are split over a CP group (``Loss.sequences_split``)."""
    if task_row(task).causal and not sequences_split:  # CP: its own attention
        attention.install(model)
    built = getattr(model, "fused_loss", None)
    if loss_of(kind).fused and (built is None or built.kind is not kind):
        raise RuntimeError(
            f"loss={kind.name}: the model must be built with model_mixin(...) for it (built "
            f"for {built.kind.name if built else 'its own loss'})"
        )
    router = build_router_aux(model, tp_ranks=tp_ranks)
    return Loss(
        kind=kind,
        causal=task_row(task).causal,
        config=cfg,
        router=router,
        sequences_split=sequences_split,
        compute_dtype=compute_dtype,
    )
