"""The eval group: what a run shows of what its model learned, beside the validation loss
(``trainer.eval_every``): sample generations from ``eval.prompts`` and lm-evaluation-harness
scores (``eval.harness_tasks``). Imports no torch, nor lm-eval."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_lab.config.errors import ConfigError, positive

HARNESS_EXTRA = "pip install 'fsdp_lab[eval]'"  # lm-evaluation-harness, which dev includes


@dataclass
class EvalConfig:
    prompts: Any = None
    """Prompts the model completes at every evaluation (trainer.eval_every boundaries, step 0 of
    a fresh run, and after the last step): a list of strings (or, for a chat model, of message
    lists), or a file: .json/.jsonl (one JSON list of prompts, or one a line: a JSON string,
    {"prompt": ...}, {"messages": [...]} or a list of messages) or a text file with one prompt
    a line. None: no generations. Written to samples.jsonl and
    every tracker."""
    max_new_tokens: int = 64
    """Tokens generated per prompt at most (fewer where it ends with EOS)."""
    temperature: float = 0.0
    """0: greedy (the default, the same text at any world size); > 0 samples."""
    top_p: float = 1.0
    """Sampling: the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0
    """Sampling: prompt i draws from a generator seeded by (seed, i): the same text at any
    world size and on every evaluation from the same weights."""
    batch_size: int = 8
    """Prompts (or harness requests) per forward on each data-parallel rank."""
    keep_gathered: bool = False
    """Generations and harness scores gather each FSDP unit's weights once, not at every
    forward (one a token): much faster, but every rank holds the whole model's weights (in
    param_dtype) meanwhile, as sharding=no_shard does. false: the memory of training."""
    harness_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (names or groups) scored on the model being trained, on
    every rank in lockstep (no export): e.g. [hellaswag,arc_easy] where the hub is reachable,
    or tasks of eval.harness_include_path. Needs the eval extra: pip install 'fsdp_lab[eval]'."""
    harness_include_path: str | None = None
    """A folder of lm-eval task YAMLs (lm-eval's --include_path), searched before its own."""
    harness_every: int = 0
    """Score the harness tasks every N optimizer steps (and before the first and after the
    last); 0: after the last step only."""
    harness_limit: int | None = None
    """At most this many documents per task (lm-eval's --limit); None: all of them."""
    harness_num_fewshot: int | None = None
    """Few-shot examples per prompt; None: each task's own default."""
    objective_metric: str | None = None
    """For objective=harness: the score an Optuna study maximizes, as `task/metric` (the names
    run.json's harness holds, e.g. arc_easy/acc); None: the first task's first metric."""


def check_eval(e: EvalConfig) -> None:
    """The eval group's single fields (the prompts themselves are read at launch)."""
    positive(e.max_new_tokens, "eval.max_new_tokens")
    positive(e.batch_size, "eval.batch_size")
    if e.temperature < 0:
        raise ConfigError(f"eval.temperature={e.temperature} must be >= 0 (0: greedy)")
    if not 0 < e.top_p <= 1:
        raise ConfigError(f"eval.top_p={e.top_p} must be in (0, 1]")
    if e.harness_every < 0:
        raise ConfigError(
            f"eval.harness_every={e.harness_every} must be >= 0 (0: after the last step)"
        )
    if e.harness_limit is not None:
        positive(e.harness_limit, "eval.harness_limit")
    if e.harness_num_fewshot is not None and e.harness_num_fewshot < 0:
        raise ConfigError(f"eval.harness_num_fewshot={e.harness_num_fewshot} must be >= 0")
    if e.harness_include_path is not None and not e.harness_tasks:
        raise ConfigError(
            "eval.harness_include_path is set but eval.harness_tasks is empty: name the tasks "
            "to score, e.g. eval.harness_tasks=[my_task]"
        )
