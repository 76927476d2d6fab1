"""The run record: run.json and the rows of metrics.jsonl as dataclasses, their keys spelled once.

Every key of those files is a field name here; ``to_dict`` writes a record as its file holds
it, ``from_dict`` reads one back. Other packages read the fields, never the keys
(tests/unit/observe/test_record.py scans for string-keyed reads).

- ``RunRecord``: run.json. The launcher claims it (``status``, ``job``), rank 0's reporter
  writes the run's ``RunFacts`` and, at the end, its ``RunResults``; a failure adds ``error``.
- ``StepRecord``, ``EvalRecord``: a row of metrics.jsonl, one per optimizer step (``"split":
  "train"``) and one per evaluation (``"val"``). A profiled window's row (``"profile"``) is
  ``observe.profile.summary.metrics_record``'s.
- ``HarnessRecord``: a row of metrics.jsonl (``"harness"``) per lm-eval evaluation;
  ``SampleRecord``: a line of samples.jsonl, one prompt's completion at one evaluation.
- ``JobRecord``: the launcher's record of a job (``launch.sweep.job_info``), run.json's ``job``.

``from_dict`` takes what any version wrote: a missing key reads None (or its default), an
unknown one is kept (``RunRecord.extra``) and written back. A key is left out while None where
its field says ``OMIT_NONE``, written as null elsewhere. Torch-free (the launcher, sweepers and
``fsdp-lab report`` read these without a model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from fsdp_lab.config import Objective

# A field's metadata: left out of the file while None; a fact every tracker records as a param.
_OMIT, _SYSTEM, _RECORD = "omit_none", "system_param", "run_json_only"
OMIT_NONE, SYSTEM_PARAM = {_OMIT: True}, {_SYSTEM: True}
MEASURED = {_OMIT: True, _RECORD: True}  # a result run.json keeps, not a summary metric


def _to_dict(obj) -> dict:
    """The record's fields in order, as its file holds them (nested values as they are)."""
    return {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if not (f.metadata.get(_OMIT) and getattr(obj, f.name) is None)
    }


def _from_dict(cls, data: dict):
    """A record of ``cls`` from its keys in data: absent ones read None (or the field's
    default), others are ignored here (``RunRecord`` keeps them)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            values[f.name] = data[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = None  # written before this key existed
    return cls(**values)


def _names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


@dataclass
class JobRecord:
    """The launcher's record of a job: run.json's ``job``, the trackers' job (``RunInfo.job``)."""

    overrides: list[str] = field(default_factory=list)  # the command line's, in order
    choices: dict[str, str] = field(default_factory=dict)  # every config group's chosen option
    sweep_dir: str | None = None  # a sweep's multirun dir (None: a single run)
    num: int | None = None  # the job's number in its sweep (a study's trial number)
    study: str | None = None  # hydra/sweeper=study: the Optuna study's name

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobRecord:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class RunFacts:
    """run.json's facts of a run, collected on every rank once it is built
    (``train.reporter.collect_facts``), never changed after: what the run measures as it goes
    is its ``RunResults``'. The trackers' params take some of them too."""

    world_size: int = field(metadata=SYSTEM_PARAM)
    num_nodes: int = field(metadata=SYSTEM_PARAM)
    hardware: str = field(metadata=SYSTEM_PARAM)
    backend: str = field(metadata=SYSTEM_PARAM)
    threads_per_rank: int
    mesh_shape: list[int] = field(metadata=SYSTEM_PARAM)
    mesh_axes: list[str] = field(metadata=SYSTEM_PARAM)
    fsdp_units: str
    num_fsdp_units: int = field(metadata=SYSTEM_PARAM)
    model_class: str = field(metadata=SYSTEM_PARAM)
    total_params: int = field(metadata=SYSTEM_PARAM)
    trainable_params: int = field(metadata=SYSTEM_PARAM)  # < total_params: freeze, lora
    local_params_per_rank: list[int]
    tokens_per_step: int = field(metadata=SYSTEM_PARAM)  # a global batch's positions
    task: str
    pretrained: bool
    load_peak_rss_bytes_per_rank: list
    activation_checkpointing: list[int]
    compiled: bool
    loss_kind: str
    optimizer: str
    data: dict  # kind, cache, blocks, tokens, documents, fingerprint, tokenizer (data=chat: chat)
    resumed_from: str | None
    start_step: int
    torch: str = field(metadata=SYSTEM_PARAM)
    flops_per_token: int
    peak_flops: float | None
    transformers: str = field(metadata=SYSTEM_PARAM)
    # Facts that exist only for some runs or from some point on: left out while unset.
    # XLA's sharding annotation per parameter:
    param_sharding: dict[str, str] | None = field(default=None, metadata=OMIT_NONE)
    # precision=float8 / finetune.quantize_base=nf4: each linear layer's precision (a name
    # pattern per layer of the stack), why a layer was kept, an NF4 base's bytes per rank:
    low_precision: dict | None = field(default=None, metadata=OMIT_NONE)
    # Each started tracker's run: ids, dirs (see logger=...):
    trackers: dict | None = field(default=None, metadata=OMIT_NONE)
    # A mixture of experts: the parameters a token uses (router, top_k of E experts), which
    # flops_per_token counts, against total_params; and the experts' layout (moe_layers,
    # num_experts, top_k, expert_params).
    active_params: int | None = field(default=None, metadata=OMIT_NONE)
    experts: dict | None = field(default=None, metadata=OMIT_NONE)

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunFacts:
        return _from_dict(cls, data)

    def system_params(self) -> dict:
        """The facts every tracker records as params (``system.<fact>``)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get(_SYSTEM)
        }


@dataclass
class RunResults:
    """A run's final and best values (``observe.run_logs.RunSummary``): run.json's and the
    trackers' summary. Steady-state medians skip each attempt's first step (warm-up)."""

    final_loss: float | None = None
    best_loss: float | None = None
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    final_val_ppl: float | None = None
    median_tokens_per_s: float | None = None
    median_tokens_per_s_per_rank: float | None = None
    median_step_time_s: float | None = None
    median_mfu: float | None = None
    peak_mem_bytes: int | None = None  # the highest over steps and ranks
    total_time_s: float | None = field(default=None, metadata=OMIT_NONE)  # once it ended
    # eval.harness_tasks (or fsdp-lab eval): the last lm-eval scores, `task/metric` -> value,
    # the step they were taken at and on what (the sharded model, or an export):
    harness: dict[str, float] | None = field(default=None, metadata=OMIT_NONE)
    harness_step: int | None = field(default=None, metadata=OMIT_NONE)
    harness_source: str | None = field(default=None, metadata=OMIT_NONE)
    # The time model's step for this run beside the measured median (planning.run_check): the
    # device priced on, both steps and their splits, the ratio, and where the run departs
    predicted: dict | None = field(default=None, metadata=OMIT_NONE)
    # Measured on the way, each once, written as it is known (train.worker): memory before
    # training, state after step 1, profile=trace|memory's analysis or files, the export's RSS
    memory_before_train_bytes_per_rank: list | None = field(default=None, metadata=MEASURED)
    state_bytes_per_rank: list | None = field(default=None, metadata=MEASURED)
    profile: dict | None = field(default=None, metadata=MEASURED)
    export_start_rss_bytes_per_rank: list | None = field(default=None, metadata=MEASURED)
    export_peak_rss_bytes_per_rank: list | None = field(default=None, metadata=MEASURED)

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunResults:
        return _from_dict(cls, data)

    def summary(self, *, step: int | None = None) -> dict:
        """The trackers' summary: the results set (not the MEASURED records), the last step."""
        kept = {f.name for f in dataclasses.fields(self) if not f.metadata.get(_RECORD)}
        results = {k: v for k, v in self.to_dict().items() if k in kept}
        return {**results, **RunRecord(step=step).to_dict()}

    def measured_fields(self) -> dict:  # the MEASURED results set
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get(_RECORD) and getattr(self, f.name) is not None
        }

    def objective(self, objective: Objective, metric: str | None = None) -> float | None:
        """What train.py returns to a sweeper for ``objective=``; None if the run has none.
        objective=harness: the score ``metric`` names (``task/metric``; None: the first)."""
        if objective is Objective.harness:
            scores = self.harness or {}
            value = scores.get(metric) if metric else next(iter(scores.values()), None)
        else:
            value = getattr(self, objective_result(objective))
        return float(value) if isinstance(value, int | float) else None


def objective_result(objective: Objective) -> str:
    """The result (a ``RunResults`` field) an ``objective=`` names."""
    match objective:
        case Objective.val_loss:
            return "final_val_loss"
        case Objective.best_val_loss:
            return "best_val_loss"
        case Objective.tokens_per_s:
            return "median_tokens_per_s"
        case Objective.harness:
            return "harness"
        case _:
            raise ValueError(f"objective={objective}: no result names it")


_FACTS, _RESULTS = _names(RunFacts), _names(RunResults)


@dataclass
class RunRecord:
    """run.json. A key is written once it is set: a claimed run has ``status`` and ``job``; a
    started one its facts; an ended one its results, ``step`` and final status."""

    # starting, running, completed, preempted or failed:
    status: str | None = field(default=None, metadata=OMIT_NONE)
    # The launcher's record of the job, kept as written (read it through job_record):
    job: dict | None = field(default=None, metadata=OMIT_NONE)
    error: str | None = field(default=None, metadata=OMIT_NONE)  # a failure's one-line cause
    step: int | None = field(default=None, metadata=OMIT_NONE)  # the last, once it ended
    # Resumed: the last step the trackers were sent before, which a continued tracker skips.
    logged_through_step: int | None = field(default=None, metadata=OMIT_NONE)
    facts: RunFacts | None = None  # its keys at run.json's top level
    results: RunResults | None = None  # its keys at run.json's top level
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as read

    _SECTIONS: ClassVar[frozenset[str]] = frozenset({"facts", "results", "extra"})

    def to_dict(self) -> dict:
        top = {k: v for k, v in _to_dict(self).items() if k not in self._SECTIONS}
        return {
            **(self.facts.to_dict() if self.facts else {}),
            **top,
            **(self.results.to_dict() if self.results else {}),
            **self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict) -> RunRecord:
        top = _names(cls) - cls._SECTIONS
        known = top | _FACTS | _RESULTS
        return cls(
            **{k: data[k] for k in top if k in data},
            facts=RunFacts.from_dict(data) if _FACTS & data.keys() else None,
            results=RunResults.from_dict(data) if _RESULTS & data.keys() else None,
            extra={k: v for k, v in data.items() if k not in known},
        )

    @property
    def job_record(self) -> JobRecord | None:
        """``job`` read through its fields; None where the launcher recorded none."""
        return JobRecord.from_dict(self.job) if isinstance(self.job, dict) else None

    @property
    def start_step(self) -> int | None:
        """The step this attempt started from (None before the facts are written)."""
        return self.facts.start_step if self.facts else None

    def tracker_runs(self) -> dict | None:
        """The trackers' runs of last time (to continue them): ``trackers``, or W&B's alone as
        run.json had it before trackers=...; None if neither."""
        if self.facts is not None and self.facts.trackers is not None:
            return self.facts.trackers
        if _BEFORE_TRACKERS in self.extra:
            return {_BEFORE_TRACKERS: self.extra[_BEFORE_TRACKERS]}
        return None


_BEFORE_TRACKERS = "wandb"  # run.json's W&B run, at the top level before trackers=... existed


@dataclass
class _Row:
    """What every row of metrics.jsonl has: its optimizer step (1-based) and its split."""

    SPLIT: ClassVar[str] = ""
    step: int

    def to_dict(self) -> dict:
        return {SPLIT_KEY: self.SPLIT, **_to_dict(self)}

    @classmethod
    def from_dict(cls, data: dict):
        return _from_dict(cls, data)


SPLIT_KEY = "split"  # train, val or profile: which record a row of metrics.jsonl is


def split_of(row: dict) -> str:
    """A row's split; rows before splits existed are train rows."""
    return row.get(SPLIT_KEY, StepRecord.SPLIT)


def step_of(row: dict) -> int:
    """A row's optimizer step, whatever its split."""
    return _Row.from_dict(row).step


@dataclass
class StepRecord(_Row):
    """One optimizer step (``observe.metrics.StepMetrics`` and its throughput)."""

    SPLIT: ClassVar[str] = "train"
    loss: float | None = None  # the mean over the global batch's trained tokens
    grad_norm: float | None = None  # before clipping
    lr: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # every position of every row of the global batch
    trained_tokens: int | None = None  # the global batch's targets
    peak_mem_bytes: int | None = None  # the highest over ranks
    peak_mem_bytes_per_rank: list[int] | None = None
    skipped: bool | None = None  # fp16: the scaler skipped the update
    elapsed_s: float | None = None  # wall time since the loop started
    # A mixture of experts' (left out for a dense model): the router's load-balancing loss,
    # and each MoE layer's load imbalance (max_e / mean_e tokens) and their max.
    aux_loss: float | None = field(default=None, metadata=OMIT_NONE)
    expert_load_imbalance: float | None = field(default=None, metadata=OMIT_NONE)
    expert_load_per_layer: list[float] | None = field(default=None, metadata=OMIT_NONE)
    trained_tokens_per_s: float | None = None
    tokens_per_s_per_rank: float | None = None
    tflops_per_s_per_rank: float | None = None  # model FLOPs
    mfu: float | None = None  # None without a known peak


@dataclass
class EvalRecord(_Row):
    """One evaluation on the held-out blocks."""

    SPLIT: ClassVar[str] = "val"
    val_loss: float | None = None
    val_ppl: float | None = None
    val_tokens: int | None = None
    eval_time_s: float | None = None


@dataclass
class HarnessRecord(_Row):
    """One lm-evaluation-harness evaluation (eval.harness_tasks, or fsdp-lab eval)."""

    SPLIT: ClassVar[str] = "harness"
    scores: dict[str, float] | None = None  # `task/metric` -> value (lm-eval's metric names)
    harness_time_s: float | None = None
    source: str | None = None  # "sharded": the model being trained; "export": its hf/ export


@dataclass
class SamplesRecord(_Row):
    """One evaluation's generations (eval.prompts), in numbers; their text is samples.jsonl's."""

    SPLIT: ClassVar[str] = "samples"
    prompts: int | None = None
    new_tokens: int | None = None  # generated over all prompts (EOS not counted)
    samples_time_s: float | None = None  # every rank's share, in lockstep: the slowest rank's


@dataclass
class SampleRecord:
    """A line of samples.jsonl: one prompt's completion at one evaluation (eval.prompts)."""

    step: int
    index: int  # the prompt's place in eval.prompts
    prompt: str
    output: str
    tokens: int  # new tokens generated (EOS not counted)

    def to_dict(self) -> dict:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SampleRecord:
        return _from_dict(cls, data)


def record_keys() -> frozenset[str]:
    """Every key run.json and the train and val rows of metrics.jsonl hold (tests scan for
    them read by string outside observe)."""
    return (
        (_names(RunRecord) - RunRecord._SECTIONS)
        | _FACTS
        | _RESULTS
        | _names(StepRecord)
        | _names(EvalRecord)
        | _names(JobRecord)
        | {SPLIT_KEY, _BEFORE_TRACKERS}
    )
