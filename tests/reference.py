"""An unsharded single-process run of the same model, data and optimizer as a sharded run.

Built from the same pieces (seeded init, each rank's batches of each step, AdamW, the
schedule), with no FSDP and the model's own loss (HF's, whatever loss.kind the run computes):
what every strategy must reproduce in fp32. The loss of a step is the mean over the global
batch's trained tokens: every rank's micro-batches' summed token losses (the model's mean times
its count of targets, an independent path from the run's sums) over the step's targets. Not the
mean of the ranks' or micro-batches' means, which differs where their counts do (a masked LM's
masks, chat data's answers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from omegaconf import OmegaConf

from fsdp_lab.config import Config, DataKind, FinetuneMethod, HardwareKind, ModelTask, to_typed
from fsdp_lab.data import corpus as corpus_lib
from fsdp_lab.data.loader import IGNORE_INDEX, build_data
from fsdp_lab.engine import finetune
from fsdp_lab.engine.model import build_full_model, build_hf_config, full_model, load_pretrained
from fsdp_lab.observe.run_logs import read_metrics
from fsdp_lab.train.optim import build_optimizer, build_scheduler, resolve_implementation


def reference_run(cfg: Config, *, world_size: int) -> tuple[list[float], list[float]]:
    """(loss, gradient norm before clipping) of every step."""
    torch.set_num_threads(1)
    t = cfg.trainer
    hf_config = build_hf_config(cfg.model)
    if cfg.model.pretrained:  # transformers' own read, not the run's
        model = load_pretrained(cfg.model.name_or_path, cfg.model.task)
    else:
        model = build_full_model(hf_config, seed=cfg.seed, task=cfg.model.task)
    model = _finetune(model, cfg, hf_config)
    model.train()
    optimizer = build_optimizer(
        model,
        cfg.optim,
        implementation=resolve_implementation(
            cfg.optim, HardwareKind.cpu, grad_scaler=cfg.precision.grad_scaler_enabled
        ),
    )
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=t.max_steps)
    tokenizer = corpus_lib.load_tokenizer(cfg)
    corpus = (
        None
        if cfg.data.kind is DataKind.synthetic
        else corpus_lib.prepare(cfg, tokenizer, vocab_size=hf_config.vocab_size)
    )
    ranks = [
        build_data(
            cfg,
            corpus=corpus,
            tokenizer=tokenizer,
            vocab_size=hf_config.vocab_size,
            dp_size=world_size,
            dp_rank=r,
        )
        for r in range(world_size)
    ]
    losses, norms = [], []
    causal = cfg.model.task is ModelTask.causal_lm
    router_coef = getattr(model.config, "router_aux_loss_coef", None)
    if router_coef is not None:
        model.router_aux_loss_coef = 0.0  # its own loss is the CE alone; the aux is added below
    for step in range(t.max_steps):
        total = 0.0
        steps = [data.step_batches(step) for data in ranks]
        targets = steps[0][1]  # every rank's count is the global batch's
        if router_coef is not None:
            total = moe_step(model, [b for b, _ in steps], targets, coef=router_coef)
        else:
            for batches, _ in steps:
                for batch in batches:
                    loss = token_loss_sum(model, batch, causal=causal)
                    (loss / targets).backward()
                    total += loss.item() / targets
        clip = cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), clip if clip is not None else math.inf
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(total)
        norms.append(norm.item())
    return losses, norms


def token_loss_sum(
    model: torch.nn.Module, batch: dict, *, causal: bool, router_logits: list | None = None
) -> torch.Tensor:
    """The summed token losses of a batch through the model's own mean loss: mean x count.
    Packed rows keep their ``position_ids``; transformers finds their sequences itself (the
    run's ``sequence_index`` is the loader's answer to the same question). ``router_logits``:
    a mixture of experts' routers' logits of this forward are appended to it."""
    inputs = {k: v for k, v in batch.items() if k != "sequence_index"}
    labels = inputs["labels"]
    count = int(((labels[:, 1:] if causal else labels) != IGNORE_INDEX).sum())
    if router_logits is not None:
        inputs["output_router_logits"] = True
    out = model(**inputs)
    if router_logits is not None:
        router_logits.append(out.router_logits)
    # No target (a masked LM's row past the split): HF's mean is nan; the sum is 0.
    return out.loss * count if count else out.logits.sum() * 0.0


def moe_step(model: torch.nn.Module, ranks: list[list[dict]], targets: int, *, coef: float):
    """A mixture of experts' step (a causal LM): micro-batch i of every rank is one global
    micro-batch; its objective is its token losses over the step's targets plus ``coef`` x
    transformers' own ``load_balancing_loss_func`` on its rows (the positions with a target),
    over the number of micro-batches. Returns the step's loss (the run logs the same sum)."""
    import importlib

    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    top_k, total = model.config.num_experts_per_tok, 0.0
    num_experts = model.model.layers[0].mlp.gate.weight.shape[0]
    num_micro = len(ranks[0])
    for micro in zip(*ranks, strict=True):
        logits, masks, value = [], [], 0.0
        for batch in micro:
            value = (
                value + token_loss_sum(model, batch, causal=True, router_logits=logits) / targets
            )
            targets_of = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
            masks.append((targets_of != IGNORE_INDEX).flatten())
        layers = tuple(torch.cat(rows) for rows in zip(*logits, strict=True))
        aux = balance(layers, num_experts, top_k, torch.cat(masks).reshape(1, -1))
        value = value + coef * aux / num_micro
        value.backward()
        total += value.item()
    return total


def _finetune(model: torch.nn.Module, cfg: Config, hf_config) -> torch.nn.Module:
    """LoRA as PEFT's users write it (``get_peft_model``), its adapters given the values the
    run's ranks draw (``engine.loading``); freezing through the run's own patterns."""
    if cfg.finetune.method is not FinetuneMethod.lora:
        finetune.apply(model, cfg.finetune)
        return model
    from peft import get_peft_model

    peft_model = get_peft_model(model, finetune.lora_config(cfg.finetune, model.config.model_type))
    drawn = full_model(
        hf_config, seed=cfg.seed, task=cfg.model.task, finetune_cfg=cfg.finetune
    ).state_dict()
    adapters = {k: v for k, v in drawn.items() if ".lora_" in k}
    missing, unexpected = peft_model.base_model.model.load_state_dict(adapters, strict=False)
    assert not unexpected and all(".lora_" not in k for k in missing), unexpected
    return peft_model


def compare(run_dir: Path, dp: int, *, steps: int, tol: float = 1e-5, norm_rtol: float = 1e-5):
    """run.json of a finished run whose every step's loss and gradient norm equal one
    unsharded process's on the same global batches (``dp`` data-parallel ranks)."""
    cfg = to_typed(OmegaConf.load(run_dir / "config.yaml"))
    records = read_metrics(run_dir / "metrics.jsonl")
    want, want_norms = reference_run(cfg, world_size=dp)
    assert len(records) == len(want) == steps
    diff = max(abs(r["loss"] - w) for r, w in zip(records, want, strict=True))
    norm = max(abs(r["grad_norm"] - n) / n for r, n in zip(records, want_norms, strict=True))
    assert diff <= tol and norm <= norm_rtol, (diff, norm)
    return json.loads((run_dir / "run.json").read_text())


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's training loss of a run."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}
