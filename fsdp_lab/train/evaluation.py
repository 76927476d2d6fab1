"""What an evaluation boundary runs, on every rank (each forward is a collective): the
validation loss (``evaluate``), and what shows what the model learned, generations from
``eval.prompts`` and lm-evaluation-harness scores of ``eval.harness_tasks`` (``BoundaryEvals``),
both on the sharded model in lockstep (no export, no second copy of the weights). The loop
(``train.loop``) says when.

Generations run at the validation's boundaries (step 0 of a fresh run, every
``trainer.eval_every`` steps, after the last); the harness after the last step, or every
``eval.harness_every`` steps (and at step 0). Rank 0 gets every rank's results and records them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.config import Config, ConfigError
from fsdp_lab.config.model import task_row
from fsdp_lab.data.prompts import EncodedPrompt, encode_prompts, read_prompts
from fsdp_lab.engine.hardware import devices, process_group
from fsdp_lab.observe.record import SampleRecord
from fsdp_lab.train.generate import (
    Lockstep,
    Request,
    Sampling,
    fit_prompt,
    generate,
    max_positions_of,
)
from fsdp_lab.train.harness import HarnessTasks
from fsdp_lab.train.loss import Loss


@dataclass
class EvalResult:
    loss: float  # mean over every predicted validation token of every rank
    perplexity: float
    tokens: int
    time_s: float


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data,
    *,
    loss: Loss,
    num_batches: int,
    device: torch.device,
    place,
    tp_ranks: int = 1,
    pipeline=None,
) -> EvalResult:
    """Validation loss over ``num_batches`` micro-batches per rank (every rank runs the same
    number: each forward is a collective). Sums of token losses and counts are all-reduced, so
    the mean is over tokens, whatever rows a rank got or how many positions a mask chose.
    ``tp_ranks``: ranks that see the same rows (a TP group), counted once. ``pipeline``
    (``engine.pipeline.Pipeline``): the batches run through its schedule, forward only, and
    only the last stage's ranks count."""
    start = time.perf_counter()
    model.eval()
    if pipeline is not None:
        pipeline.train(False)
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for index in range(num_batches):
        batch = place(data.val_batch(index))
        if pipeline is not None:
            sums += pipeline.token_sums(batch, loss)
        else:
            sums += loss.token_sums(model, batch)
        devices.mark_step(device)
    sums = sums.to(process_group.collective_device(device))
    dist.all_reduce(sums)
    model.train()
    if pipeline is not None:
        pipeline.train(True)
    total, count = (x / tp_ranks for x in sums.tolist())
    mean = total / max(count, 1.0)
    return EvalResult(
        loss=mean,
        perplexity=math.exp(min(mean, 700.0)),
        tokens=int(count),
        time_s=time.perf_counter() - start,
    )


@dataclass(frozen=True)
class HarnessScores:
    """One harness evaluation: each task's metrics (``acc``, ``exact_match/strict-match``)."""

    scores: dict[str, dict[str, float]]
    time_s: float

    def flat(self) -> dict[str, float]:
        """``task/metric`` -> value, as run.json, metrics.jsonl and the trackers hold them."""
        return {f"{t}/{m}": v for t, metrics in self.scores.items() for m, v in metrics.items()}


@dataclass
class Decoding:
    """What turns a model's tokens into text and back: the tokenizer and its special ids."""

    tokenizer: object
    eos_ids: set[int]
    pad_id: int
    max_positions: int | None

    @classmethod
    def of(cls, tokenizer, hf_config) -> Decoding:
        eos = getattr(tokenizer, "eos_token_id", None)
        config_eos = getattr(hf_config, "eos_token_id", None)
        ids = {i for v in (eos, config_eos) for i in (v if isinstance(v, list) else [v])}
        ids.discard(None)
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (min(ids) if ids else 0)
        return cls(tokenizer, ids, pad, max_positions_of(hf_config))

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def check_eval_setup(cfg: Config, tokenizer, hf_config) -> list[EncodedPrompt]:
    """The launcher's check of the eval group against the model and tokenizer: one line for a
    run with prompts or harness tasks and no tokenizer, a model that does not generate, a
    max_new_tokens beyond the model's positions, or a prompt that cannot be read or rendered."""
    e = cfg.eval
    if e.prompts is None and not e.harness_tasks:
        return []
    what = "eval.prompts" if e.prompts is not None else "eval.harness_tasks"
    if tokenizer is None:
        raise ConfigError(
            f"{what} needs a tokenizer, and data={cfg.data.kind.name} has none; set "
            "data.tokenizer=<a tokenizer directory>, or train on text (data=shakespeare)"
        )
    if not task_row(cfg.model.task).causal:
        raise ConfigError(
            f"{what} needs a causal language model (model.task=causal_lm); "
            f"model.task={cfg.model.task.name} does not generate"
        )
    limit = max_positions_of(hf_config)
    if limit is not None and e.max_new_tokens >= limit:
        raise ConfigError(
            f"eval.max_new_tokens={e.max_new_tokens} leaves no room for a prompt within the "
            f"model's {limit} positions; set eval.max_new_tokens below {limit}"
        )
    return encode_prompts(read_prompts(e.prompts), tokenizer, cfg.data.chat_template)


class BoundaryEvals:
    """Generations and harness scores at the boundaries the loop asks for; every rank calls
    them together (each forward is a collective)."""

    def __init__(self, cfg: Config, tokenizer, hf_config, lock: Lockstep) -> None:
        e, t = cfg.eval, cfg.trainer
        self.prompts = check_eval_setup(cfg, tokenizer, hf_config)
        self.decoding = Decoding.of(tokenizer, hf_config) if tokenizer is not None else None
        self.sampling = Sampling(e.max_new_tokens, e.temperature, e.top_p, e.seed)
        self.lock, self.batch_size = lock, e.batch_size
        self.keep_gathered = e.keep_gathered
        self._eval_every, self._max_steps = t.eval_every, t.max_steps
        self._harness = None
        if e.harness_tasks:
            self._harness = HarnessTasks.of(e)
        self._harness_every = e.harness_every

    @classmethod
    def of(cls, cfg: Config, tokenizer, hf_config, lock: Lockstep) -> BoundaryEvals | None:
        """None where the run asks for neither generations nor harness scores."""
        if cfg.eval.prompts is None and not cfg.eval.harness_tasks:
            return None
        return cls(cfg, tokenizer, hf_config, lock)

    def samples_due(self, step: int) -> bool:
        """At the validation's boundaries: step 0, every eval_every steps, the last."""
        every = self._eval_every
        return bool(self.prompts) and bool(every) and (step % every == 0 or step == self._max_steps)

    def harness_due(self, step: int) -> bool:
        """After the last step; with eval.harness_every also at step 0 and every N steps."""
        if self._harness is None:
            return False
        every = self._harness_every
        return step == self._max_steps or bool(every and step % every == 0)

    def generate(self, model: nn.Module, step: int) -> list[SampleRecord]:
        """Every prompt's completion (on every rank: each has all of them)."""
        d = self.decoding
        room = self.sampling.max_new_tokens
        requests = [
            Request(p.index, fit_prompt(p.ids, room, d.max_positions)) for p in self.prompts
        ]
        mine = self.lock.share(requests)
        outputs = generate(
            model,
            mine,
            self.sampling,
            lock=self.lock,
            batch_size=self.batch_size,
            eos_ids=d.eos_ids,
            pad_id=d.pad_id,
        )
        done = self.lock.gather([(r.index, out) for r, out in zip(mine, outputs, strict=True)])
        return [
            SampleRecord(step, p.index, p.text, d.text(out), len(out))
            for p, out in zip(self.prompts, done, strict=True)
        ]

    def score(self, model: nn.Module) -> HarnessScores:
        """The harness tasks on the sharded model (every rank computes the same scores)."""
        from fsdp_lab.train.harness_lm import ShardedLM

        start = time.perf_counter()
        lm = ShardedLM(model, self.decoding, lock=self.lock, batch_size=self.batch_size)
        scores = self._harness.evaluate(lm)
        return HarnessScores(scores, time.perf_counter() - start)
