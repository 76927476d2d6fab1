"""``parallel.pipeline``: a Hugging Face causal LM cut into stages of whole decoder layers,
run by torch's pipeline schedules (``torch.distributed.pipelining``), each stage sharded by
FSDP2 over its own ranks. The model is cut through its own forwards, never patched:

- This rank's model (``keep``) is the meta model without what none of its stages holds: a
  decoder layer becomes a ``SkippedLayer`` (it hands the hidden states on), the embedding,
  final norm and head an ``nn.Identity``. Kept tensors keep their names, so DCP checkpoints
  (resumed under any pipeline) and the Hugging Face export are the unsplit model's.
- Each stage runs a view of it (``stage_view``), the layers of the rank's other stages
  skipped too, through the model's own forward: the first stage from ``input_ids``, a later
  one from the previous stage's hidden states as ``inputs_embeds``; the last computes the
  loss (a fused loss in its head, as unsplit). Each stage builds its masks from its batch.

Loss and gradients are exact: the last stage returns each microbatch's summed token losses
scaled as the step scales a micro-batch (``dp / the global targets``); FSDP averages over
the stage's data-parallel ranks as unsplit; the schedule does not scale
(``scale_grads=False``). The step's loss and the gradient norm's square are summed over the
pipeline axis.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_lab.config import ConfigError, ParallelConfig, families
from fsdp_lab.config.pipeline import PIPELINE_AXIS, PipelineLayout, layout
from fsdp_lab.engine.conversion import owned_tensors
from fsdp_lab.engine.hardware.devices import TORCH_DTYPES
from fsdp_lab.engine.loading import gather_whole, recompute_buffers

BASE, LAYERS, EMBED, NORM, HEAD = "model", "layers", "embed_tokens", "norm", "lm_head"


def check(
    hf_config, parallel: ParallelConfig, micro_batch_size: int, *, frozen_base: bool = False
) -> PipelineLayout:
    """The run's stages, or a one-line refusal: a family the split does not serve, tied
    embeddings, a layout the schedule cannot run (``config.pipeline.layout``), and with a
    frozen base (``frozen_base``: LoRA, freeze) a rank holding no decoder layer (nothing to
    train there: its optimizer would hold no state)."""
    n = parallel.pipeline
    model_type = getattr(hf_config, "model_type", "?")
    row = families.family_of(model_type)
    if row is None or not row.pipeline:
        runs = ", ".join(families.pipeline_types())
        raise ConfigError(
            f"parallel.pipeline={n}: model_type={model_type} cannot be cut into stages through "
            f"its own forwards (PP runs {runs}); set parallel.pipeline=1"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        # the first and the last stage would each own the tensor (and under a V schedule two
        # FSDP roots on rank 0 would each shard it): the tie would not hold
        raise ConfigError(
            f"parallel.pipeline={n}: the model ties its head to its embedding "
            "(tie_word_embeddings), which the first and the last stage hold apart; use a model "
            "with untied embeddings (model.tie_word_embeddings=false) or parallel.pipeline=1"
        )
    stages = layout(parallel, hf_config.num_hidden_layers, micro_batch_size)
    idle = [r for r in range(n) if not rank_layers(stages, r)[0]]
    if frozen_base and idle:
        raise ConfigError(
            f"parallel.pipeline={n}: pipeline rank {idle[0]} holds no decoder layer (stages "
            f"{stages.stages_of(idle[0])}: the embedding or the head alone), and with a frozen "
            "base it would train nothing; give every rank a layer with parallel.pipeline_layers "
            "(or fewer stages)"
        )
    return stages


class SkippedLayer(nn.Module):
    """Another stage's decoder layer: the hidden states pass through; ``attention_type`` kept."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _parts(lm: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    base = getattr(lm, BASE)
    return base, getattr(base, LAYERS)


def keep(lm: nn.Module, layers: set[int], *, embed: bool, head: bool) -> None:
    """Take out of ``lm`` (in place, on meta) what this rank's stages do not hold."""
    base, blocks = _parts(lm)
    for i in range(len(blocks)):
        if i not in layers:
            blocks[i] = SkippedLayer(blocks[i])
    if not embed:
        setattr(base, EMBED, nn.Identity())
    if not head:
        setattr(base, NORM, nn.Identity())
        setattr(lm, HEAD, nn.Identity())


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its submodules, parameters and buffers, with its own
    registries (so a child replaced or a hook added on the copy stays on the copy)."""
    view = copy.copy(module)
    for key, value in list(vars(view).items()):
        if isinstance(value, dict):
            setattr(view, key, type(value)(value))
    return view


def stage_view(lm: nn.Module, layers: tuple[int, ...], *, first: bool, last: bool) -> nn.Module:
    """The causal LM one stage runs: ``lm``'s modules, the layers outside ``layers`` skipped,
    the embedding only on the first stage, the final norm and head only on the last."""
    view = _shallow(lm)
    base = _shallow(getattr(lm, BASE))
    setattr(view, BASE, base)
    blocks = getattr(base, LAYERS)
    owned = set(layers)
    setattr(
        base,
        LAYERS,
        nn.ModuleList(
            b if i in owned or isinstance(b, SkippedLayer) else SkippedLayer(b)
            for i, b in enumerate(blocks)
        ),
    )
    if not first:
        setattr(base, EMBED, nn.Identity())
    if not last:
        setattr(base, NORM, nn.Identity())
        setattr(view, HEAD, nn.Identity())
    return view


class Stage(nn.Module):
    """One stage as the schedule calls it: ``forward(x, **batch)``, ``x`` the micro-batch's
    ``input_ids`` on the first stage and the previous stage's hidden states on the others; it
    returns its hidden states, or on the last stage the microbatch's summed token losses (fp32).
    The FSDP root of its modules (``fully_shard`` is applied to it)."""

    def __init__(self, lm: nn.Module, loss, *, index: int, first: bool, last: bool) -> None:
        super().__init__()
        self.lm = lm
        self.index, self.first, self.last = index, first, last
        self._loss = (loss,)  # not a submodule

    def forward(self, x: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor:
        loss = self._loss[0]
        return loss.stage_value(
            self.lm, batch, inputs_embeds=None if self.first else x, last=self.last
        )


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them; what the step and the evaluation
    call instead of the model's forward."""

    layout: PipelineLayout
    stages: list[Stage]  # this rank's, in order
    schedule: object  # torch's
    group: dist.ProcessGroup  # the pipeline axis through this rank
    device: torch.device
    hidden_size: int  # what passes between stages: B x T x hidden_size
    hidden_dtype: torch.dtype  # in the compute dtype
    scale: torch.Tensor | None = None  # the current micro-batch's loss scale

    @property
    def holds_last(self) -> bool:
        return any(s.last for s in self.stages)

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output * self.scale

    def train_value(
        self, batch: dict[str, torch.Tensor], scale: torch.Tensor, scaler=None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch through the schedule; the summed scaled
        losses of its microbatches on a rank holding the last stage, else a zero. ``scaler``
        (fp16): the backward runs from the losses it scales, the value returned unscaled."""
        self.scale = scale if scaler is None else scaler.scale(scale)
        losses: list[torch.Tensor] = []
        inputs = {k: v for k, v in batch.items() if v is not None}
        self.schedule.step(
            inputs["input_ids"],
            target=inputs["labels"],
            losses=losses,
            return_outputs=False,
            **inputs,
        )
        if self.holds_last:
            total = torch.stack([x.detach().float().reshape(()) for x in losses]).sum()
            return total * (scale / self.scale) if scaler is not None else total
        return torch.zeros((), dtype=torch.float32, device=batch["input_ids"].device)

    @torch.no_grad()
    def token_sums(self, batch: dict[str, torch.Tensor], loss) -> torch.Tensor:
        """(sum of token losses, tokens counted) in float64 on the ranks of the last stage,
        zeros on the others: all-reduced over the world it counts each row once. The whole
        micro-batch passes the stages in order, forward only (torch's ``eval`` cannot run the
        zero-bubble schedules' split backward's actions without a backward)."""
        inputs = {k: v for k, v in batch.items() if v is not None}
        me, hidden, total = dist.get_rank(self.group), None, None
        by_index = {s.index: s for s in self.stages}
        for index in range(self.layout.stages):
            owner = self.layout.rank_of(index)
            before = self.layout.rank_of(index - 1) if index else owner
            if index and before == me and owner != me:
                dist.send(hidden.contiguous(), dist.get_global_rank(self.group, owner), self.group)
            if owner != me:
                continue
            if index and before != me:
                shape = (*inputs["input_ids"].shape, self.hidden_size)
                hidden = torch.empty(shape, dtype=self.hidden_dtype, device=self.device)
                dist.recv(hidden, dist.get_global_rank(self.group, before), self.group)
            out = by_index[index](inputs["input_ids"] if index == 0 else hidden, **inputs)
            if by_index[index].last:
                total = out
            else:
                hidden = out
        count = loss.target_count(batch["labels"])
        if total is None:
            return torch.zeros(2, dtype=torch.float64, device=batch["input_ids"].device)
        return torch.stack([total.double(), count.double()])

    def first_rank(self, pipeline_rank: int) -> int:
        """The first global rank of a pipeline rank's stage (``world / pipeline`` contiguous)."""
        return pipeline_rank * (dist.get_world_size() // self.layout.pipeline)

    def owner(self, name: str) -> int:
        """The pipeline rank holding tensor ``name`` (a plain name of the unsplit model)."""
        lay, parts = self.layout, name.split(".")
        if parts[:2] == [BASE, LAYERS]:
            layer = int(parts[2])
            return lay.rank_of(next(s for s, held in enumerate(lay.layers) if layer in held))
        return lay.rank_of(0 if parts[:2] == [BASE, EMBED] else lay.stages - 1)

    def full_tensors(self, owned: dict, names: list[str], like: dict) -> dict | None:
        """The whole tensors ``names`` on the host of rank 0 (others: None); every rank calls
        it with the same names. Each is gathered over the ranks of the stage holding it
        (``owned``: this rank's), whose first rank sends it to rank 0; ``like``: the unsplit
        model's tensors on meta (what rank 0 receives: shape and dtype)."""
        me, mine, out = dist.get_rank(), dist.get_rank(self.group), {}
        for name in names:
            holder = self.owner(name)
            first = self.first_rank(holder)
            if mine == holder:
                whole = gather_whole(owned[name][2]).detach().to(like[name].dtype)
                if me == 0:
                    out[name] = whole.cpu()
                elif me == first:
                    dist.send(whole.contiguous(), 0)
                del whole
            elif me == 0:
                buffer = torch.empty(like[name].shape, dtype=like[name].dtype, device=self.device)
                dist.recv(buffer, first)
                out[name] = buffer.cpu()
        return out if me == 0 else None

    @contextlib.contextmanager
    def gathered(self, owned: dict, unsplit: nn.Module) -> Iterator[nn.Module]:
        """The whole model on every rank for the block (generation and harness scores run
        whole sequences through it, without collectives): ``unsplit`` (meta) given storage,
        each tensor gathered over the ranks of the stage holding it and broadcast by that
        stage's first rank; freed after. Every rank calls it."""
        whole = copy.deepcopy(unsplit)
        whole.to_empty(device=self.device)
        recompute_buffers(whole)
        with torch.no_grad():
            for name, (_, _, target) in sorted(owned_tensors(whole).items()):
                holder = self.owner(name)
                if dist.get_rank(self.group) == holder:
                    target.copy_(gather_whole(owned[name][2]))
                dist.broadcast(target, self.first_rank(holder))
        whole.eval()
        yield whole  # freed with this frame when the block ends

    def train(self, mode: bool = True) -> None:
        for stage in self.stages:
            stage.train(mode)

    def reduce(self, value: torch.Tensor) -> torch.Tensor:
        """A per-stage sum summed over the pipeline axis (every pipeline rank then holds it)."""
        dist.all_reduce(value, group=self.group)
        return value


def build_stages(lm: nn.Module, cut: PipelineCut | None, loss) -> list[Stage] | None:
    """This rank's stage modules over ``lm`` (already ``cut``); None without a pipeline."""
    if cut is None:
        return None
    out, stages = [], cut.layout
    for s in stages.stages_of(cut.rank):
        first, last = s == 0, s == stages.stages - 1
        view = stage_view(lm, stages.layers[s], first=first, last=last)
        out.append(Stage(view, loss, index=s, first=first, last=last))
    return out


def rank_layers(stages: PipelineLayout, pipeline_rank: int) -> tuple[set[int], bool, bool]:
    """The decoder layers this rank's stages hold, and whether it holds the embedding and the
    head."""
    mine = stages.stages_of(pipeline_rank)
    layers = {i for s in mine for i in stages.layers[s]}
    return layers, 0 in mine, stages.stages - 1 in mine


def build_schedule(
    stage_modules: list[Stage], cut: PipelineCut, mesh: DeviceMesh, device: torch.device, precision
) -> Pipeline:
    """torch's stages and schedule over this rank's stage modules (FSDP-sharded already);
    ``precision``: the run's (hidden states pass between stages in its compute dtype)."""
    stages, hidden_dtype = cut.layout, TORCH_DTYPES[precision.param_dtype]
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    group = mesh.get_group(PIPELINE_AXIS)
    torch_stages = [
        PipelineStage(m, m.index, stages.stages, device, group=group) for m in stage_modules
    ]
    lm = stage_modules[0].lm
    pipeline = Pipeline(
        stages,
        stage_modules,
        None,
        group,
        device=device,
        hidden_size=lm.config.hidden_size,
        hidden_dtype=hidden_dtype,
    )
    cls = get_schedule_class(stages.schedule.name)
    schedule = cls(
        torch_stages if stages.schedule.multi else torch_stages[0],
        n_microbatches=stages.microbatches,
        loss_fn=pipeline._loss_fn,
        scale_grads=False,
    )
    pipeline.schedule = schedule
    return pipeline


def check_stage_numbers(model: nn.Module, stages: PipelineLayout) -> None:
    """The meta model's decoder has the layers the layout cut (a config/model mismatch is a
    bug, not a user error)."""
    _, blocks = _parts(model)
    total = sum(len(s) for s in stages.layers)
    if len(blocks) != total:
        raise RuntimeError(f"pipeline layout cuts {total} layers; the model has {len(blocks)}")


@dataclass(frozen=True)
class PipelineCut:
    """What ``cut`` took: the layout, this rank on the pipeline axis, its decoder layers, and
    the unsplit model on meta (the seeded init draws as it)."""

    layout: PipelineLayout
    rank: int
    layers: set[int]
    whole: nn.Module


def describe(units: str, cut: PipelineCut | None) -> str:
    """The banner's units line (``wrap.summarize_units``'s); under a pipeline, this rank's
    stages, each the root of its units, and the schedule."""
    if cut is None:
        return units
    lay = cut.layout
    mine = ", ".join(
        f"{s} (layers {lay.layers[s][0]}-{lay.layers[s][-1]})" if lay.layers[s] else f"{s}"
        for s in lay.stages_of(cut.rank)
    )
    return (
        f"{units.split('root ')[0].rstrip(', ') or 'no unit'}, each stage a root; stage(s) "
        f"{mine} of {lay.stages} on pipeline rank {cut.rank}, {lay.schedule.name}, "
        f"{lay.microbatches} microbatches"
    )


def cut(model: nn.Module, parallel: ParallelConfig, micro_batch_size: int, mesh: DeviceMesh):
    """parallel.pipeline > 1: the meta model cut in place to what this rank's stages hold
    (names kept, ``keep``); None without a pipeline."""
    if parallel.pipeline == 1:
        return None
    frozen_base = any(not p.requires_grad for p in model.parameters())
    stages = check(model.config, parallel, micro_batch_size, frozen_base=frozen_base)
    check_stage_numbers(model, stages)
    rank = mesh.get_local_rank(PIPELINE_AXIS)
    layers, embed, head = rank_layers(stages, rank)
    whole = copy.deepcopy(model)
    keep(model, layers, embed=embed, head=head)
    return PipelineCut(stages, rank, layers, whole)
