"""`fsdp-lab tune [OVERRIDES] --memory-gib X`: the fastest FSDP setup that fits X GiB per rank.

    fsdp-lab tune model=local model.name_or_path=$HOME/smollm2 trainer.seq_len=512 --memory-gib 6

1. **Enumerate** sharding strategy x activation checkpointing (none, selective every 2, full) x
   offload (none, cpu; not on hardware=cpu, where it moves nothing) x micro-batch (powers of two
   up to ``--max-micro-batch``) x tensor-parallel degree (1, 2, 4, 8 dividing the ranks per
   node, where the model's TP plan takes it) x, for a mixture of experts, expert-parallel
   degree (1, 2, 4, 8 dividing its experts and the shard axis). Model, data, sequence length,
   ranks and precision are the overrides'; an axis the overrides set (``sharding=full``) is
   held there. With ``--keep-global-batch`` each candidate's grad_accum_steps makes up the
   overrides' global batch (micro-batches that cannot are left out).
2. **Drop** what the plan (``fsdp-lab plan``, no device) says exceeds the budget, with its margin:
   predicted peak = process baseline + ``SAFETY`` x the plan's peak + ``SLACK``.
3. **Probe** the ``--probes`` best of the rest (by a prior: less recomputation, larger
   micro-batches, less communication per token; the second probe of another TP degree than
   the first's) on the real ranks: a few steps each, measuring
   peak memory and tokens/s. A probe over the budget (on CPU, its RSS; on GPU, a CUDA OOM) is a
   verdict, not a crash.
4. **Print** a table and the winning command; write ``tune.json``.

The budget's basis is what train.py reports as peak memory per rank: on CPU the resident-set
high-water mark (VmHWM) of each rank process, interpreter and imports included (the baseline is
measured here, in a fresh interpreter importing what a rank imports); on GPU the caching
allocator's peak (the CUDA context is outside it: baseline 0). On CPU every probe, and the
printed command, set ``hardware.malloc_mmap_threshold=131072`` (unless the overrides set it) so
that freed activation memory leaves the RSS (glibc's default keeps it: RSS then overstates live
tensors up to 2x, and the plan could not predict it).
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.config import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    ConfigError,
    HardwareKind,
    OffloadConfig,
    OffloadDevice,
    ShardingStrategy,
)
from fsdp_lab.config.rules import validate
from fsdp_lab.config.strategies import strategy_of
from fsdp_lab.config.topology import dp_size
from fsdp_lab.observe import rundir
from fsdp_lab.tools import plan
from fsdp_lab.tools.plan_result import StrategyPlan

GIB, MIB = 2**30, 2**20
# The plan's known error on real ranks (tests/integration/test_plan_runs.py, every preset
# architecture, full/grad_op/no_shard, 2026-11-24): measured peak less the RSS before training
# is 1.00-1.14x the plan's plus 8-25 MiB of the process's own; and a rank's RSS before its
# model (353-356 MiB) is ~60 MiB above the fresh interpreter the baseline measures (296 MiB).
# 1.15 x plan + 96 MiB covers both; a probe that measures more raises the baseline for the rest.
SAFETY, SLACK = 1.15, 96 * MIB
MALLOC_OVERRIDE = "hardware.malloc_mmap_threshold=131072"  # on CPU: RSS that the plan predicts
AC_OPTIONS = ("none", "selective", "full")
RECOMPUTE = {"none": 1.0, "selective": 1 + 1 / 6, "full": 4 / 3}  # of one fwd+bwd (3 units)
# FLOPs per byte moved at which communication costs as much as compute, per device: a prior
# for ordering probes only (the probes measure).
FLOPS_PER_COMM_BYTE = {HardwareKind.cpu: 50.0, HardwareKind.gpu: 2000.0}
OFFLOAD_PENALTY = 1.5  # offload=cpu on GPU: host AdamW and PCIe copies each step


@dataclass
class Candidate:
    strategy: ShardingStrategy
    ac: str  # none, selective, full
    offload: bool
    micro_batch: int
    tensor: int = 1  # parallel.tensor
    expert: int = 1  # parallel.expert
    grad_accum: int | None = None  # trainer.grad_accum_steps, set under --keep-global-batch
    planned_bytes: int = 0  # predicted peak per rank on the budget's basis, margin included
    plan_peak_bytes: int = 0  # the plan's tensors alone
    prior: float = 0.0  # relative time per token (lower is faster), for ordering probes
    measured_bytes: int | None = None
    tokens_per_s: float | None = None
    verdict: str = "not probed"
    run_dir: str | None = None

    def overrides(self) -> list[str]:
        return [
            f"sharding={self.strategy.name}",
            f"activation_checkpointing={self.ac}",
            f"offload={'cpu' if self.offload else 'none'}",
            f"trainer.micro_batch_size={self.micro_batch}",
            *([f"parallel.tensor={self.tensor}"] if self.tensor > 1 else []),
            *([f"parallel.expert={self.expert}"] if self.expert > 1 else []),
            *([f"trainer.grad_accum_steps={self.grad_accum}"] if self.grad_accum else []),
        ]

    @property
    def name(self) -> str:
        return " ".join(self.overrides())


@dataclass
class TuneResult:
    budget_bytes: int
    baseline_bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    keep_global_batch: bool = False
    winner: Candidate | None = None
    command: str | None = None


@dataclass
class Grid:
    """Axes restricted by the command line (--sharding, --checkpointing, --micro-batches,
    --tensor; None: every value), and --keep-global-batch: every candidate trains on the
    overrides' sequences per optimizer step (micro-batch x grad_accum_steps x data-parallel
    ranks), its grad_accum_steps set to make up its micro-batch."""

    strategies: list[ShardingStrategy] | None = None
    checkpointing: list[str] | None = None
    micro_batches: list[int] | None = None
    tensor: list[int] | None = None
    keep_global_batch: bool = False
    expert: list[int] | None = None  # --expert: EP degrees (MoE models; else 1 only)

    @classmethod
    def parse(
        cls,
        sharding: str | None,
        checkpointing: str | None,
        micro: str | None,
        tensor: str | None = None,
        keep_global_batch: bool = False,
        expert: str | None = None,
    ) -> Grid:
        def items(text: str | None, flag: str, allowed: list[str]) -> list[str] | None:
            if text is None:
                return None
            values = [v.strip() for v in text.split(",") if v.strip()]
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ConfigError(f"{flag} {text}: use a comma list of {', '.join(allowed)}")
            return values

        def sizes(text: str | None, flag: str) -> list[int] | None:
            if text is None:
                return None
            try:
                values = [int(v) for v in text.split(",")]
            except ValueError:
                values = []
            if not values or min(values) < 1:
                raise ConfigError(f"{flag} {text}: use a comma list of sizes >= 1")
            return values

        names = items(sharding, "--sharding", [s.name for s in ShardingStrategy])
        return cls(
            strategies=[ShardingStrategy[n] for n in names] if names else None,
            checkpointing=items(checkpointing, "--checkpointing", list(AC_OPTIONS)),
            micro_batches=sizes(micro, "--micro-batches"),
            tensor=sizes(tensor, "--tensor"),
            keep_global_batch=keep_global_batch,
            expert=sizes(expert, "--expert"),
        )


def _key(override: str) -> str:
    """``+trainer.seq_len=64`` -> ``trainer.seq_len``."""
    return override.split("=", 1)[0].lstrip("+~")


def _held(overrides: list[str], *keys: str) -> bool:
    return any(_key(o) in keys for o in overrides)


def _axes(cfg, topo, overrides: list[str], grid: Grid, max_micro_batch: int) -> tuple:
    """(strategies, checkpointing modes, offloads, micro-batches, TP degrees) to enumerate: the
    grid's, or every value; an axis the overrides set is held at its value."""
    strategies = grid.strategies or list(ShardingStrategy)
    if _held(overrides, "sharding"):
        strategies = [cfg.sharding.strategy]
    acs = grid.checkpointing or list(AC_OPTIONS)
    if _held(overrides, "activation_checkpointing"):
        acs = [cfg.activation_checkpointing.mode.name]
    offloads = [cfg.offload.device is OffloadDevice.cpu]
    if not _held(overrides, "offload") and topo.device is not HardwareKind.cpu:
        offloads = [False, True]
    batches = grid.micro_batches or [
        2**i for i in range(max_micro_batch.bit_length()) if 2**i <= max_micro_batch
    ]
    if _held(overrides, "trainer.micro_batch_size"):
        batches = [cfg.trainer.micro_batch_size]
    tensors = grid.tensor or [t for t in (1, 2, 4, 8) if topo.nproc_per_node % t == 0]
    if _held(overrides, "parallel.tensor"):
        tensors = [cfg.parallel.tensor]
    experts = grid.expert or [1, 2, 4, 8]  # those the model and ranks refuse are dropped
    if _held(overrides, "parallel.expert"):
        experts = [cfg.parallel.expert]
    return strategies, acs, offloads, batches, tensors, experts


def enumerate_candidates(
    overrides: list[str], max_micro_batch: int, grid: Grid | None = None
) -> tuple[list[Candidate], HardwareKind, int]:
    """Every candidate the topology can run, with the plan's peak: (candidates, device, world
    size). ``grid`` restricts the axes. Raises ConfigError for overrides the plan refuses."""
    grid = grid or Grid()
    cfg = plan.compose(overrides)
    topo, _ = plan.topology(cfg)
    validate(cfg, topo)
    strategies, acs, offloads, batches, tensors, experts = _axes(
        cfg, topo, overrides, grid, max_micro_batch
    )
    rows = global_batch(cfg, topo) if grid.keep_global_batch else None
    out, indivisible = [], set()
    for ac, tp, ep in itertools.product(acs, tensors, experts):
        model_axes = _model_axes(cfg, topo, ac=ac, tensor=tp, expert=ep)
        if model_axes is None:
            continue
        base, facts = model_axes
        for strategy, offload, mb in itertools.product(strategies, offloads, batches):
            accum = base.trainer.grad_accum_steps
            if rows is not None:
                share = mb * dp_size(topo, tp)  # sequences per micro-step, all ranks
                if rows % share:
                    indivisible.add((mb, tp))  # it cannot make up the global batch
                    continue
                accum = rows // share
            variant = dataclasses.replace(
                base,
                offload=OffloadConfig(device=OffloadDevice.cpu if offload else OffloadDevice.none),
                trainer=dataclasses.replace(
                    base.trainer, micro_batch_size=mb, grad_accum_steps=accum
                ),
            )
            try:
                s = plan.strategy_plan(variant, topo, facts, strategy)
            except ConfigError:
                continue
            if isinstance(s, StrategyPlan):
                c = Candidate(
                    strategy,
                    ac,
                    offload,
                    mb,
                    tensor=tp,
                    expert=ep,
                    grad_accum=accum if rows is not None else None,
                    plan_peak_bytes=s.peak,
                )
                c.prior = _prior(c, facts, cfg.trainer.seq_len, topo)
                out.append(c)
    if not out and indivisible:
        raise ConfigError(_indivisible(batches, rows, dp_size(topo)))
    return out, topo.device, topo.world_size


def _model_axes(cfg, topo, *, ac: str, tensor: int, expert: int):
    """(the config with these checkpointing, TP and EP settings, the plan's model facts), or
    None where the rules or the model refuse them: a TP degree the heads do not divide, EP on
    a dense model or with experts the degree does not divide."""
    base = dataclasses.replace(
        cfg,
        activation_checkpointing=ActivationCheckpointingConfig(
            mode=ActivationCheckpointingMode[ac], every=cfg.activation_checkpointing.every
        ),
        parallel=dataclasses.replace(cfg.parallel, tensor=tensor, expert=expert),
    )
    try:
        validate(base, topo)
        facts = plan.inspect_model(base, topo.device)
    except ConfigError:
        return None
    if expert > 1 and (not facts.layer.experts or facts.layer.experts % expert):
        return None
    return base, facts


def _indivisible(batches: list[int], rows: int, dp: int) -> str:
    return (
        f"--keep-global-batch: no micro-batch tried ({', '.join(map(str, batches))}) makes up "
        f"the global batch of {rows} sequences per step: {rows // dp} per data-parallel rank "
        f"(more under TP); try --micro-batches that divide {rows // dp}"
    )


def global_batch(cfg, topo) -> int:
    """Sequences per optimizer step: micro-batch x grad_accum_steps x data-parallel ranks."""
    t = cfg.trainer
    return t.micro_batch_size * t.grad_accum_steps * dp_size(topo, cfg.parallel.tensor)


def _prior(c: Candidate, facts: plan.ModelShape, seq_len: int, topo) -> float:
    """Relative time per token, for ordering probes: compute (6 FLOPs per parameter, times the
    recomputation) plus bytes moved per token weighted by the device's FLOPs per byte: FSDP's
    (4 bytes per parameter per communication unit, once per micro-batch) and TP's (two
    all-reduces of the hidden state per layer, forward and backward)."""
    w = FLOPS_PER_COMM_BYTE[topo.device]
    dp = topo.world_size // c.tensor
    traffic = strategy_of(c.strategy).traffic  # parameter bytes per micro-batch, in params
    fsdp = 4 * traffic / (c.micro_batch * seq_len) if dp > 1 else 0
    layer = facts.layer
    tp = 32 * layer.num_layers * layer.hidden * (c.tensor - 1) / max(facts.total_params, 1)
    # EP: four all-to-alls of each token's top-k rows per MoE layer (dispatch and combine,
    # forward and backward, fp32), and FSDP gathers 1/ep of the experts.
    moe = 16 * layer.top_k * layer.hidden * layer.num_layers * (c.expert - 1) / c.expert
    ep = moe / max(facts.total_params, 1)
    experts = sum(p.numel for p in facts.params if p.expert_dim1) / max(facts.total_params, 1)
    fsdp *= 1 - experts * (1 - 1 / c.expert)
    penalty = OFFLOAD_PENALTY if c.offload else 1.0
    return (6 * RECOMPUTE[c.ac] + w * (fsdp + tp + ep)) * penalty


def probe_order(candidates: list[Candidate]) -> list[Candidate]:
    """By the prior, except that the second probe is the best of another tensor-parallel degree
    than the first's: the prior's TP term is its crudest (it leaves out per-micro-batch
    overheads, which made it rank TP 2 at micro-batch 1 over TP 1 at 4, measured 9x slower on
    the tiny Llama). One probe, not one per degree: on 8 GPUs that would be all three."""
    ranked = sorted(candidates, key=lambda c: (c.prior, c.planned_bytes))
    other = next((c for c in ranked if ranked and c.tensor != ranked[0].tensor), None)
    if other is None:
        return ranked
    return [ranked[0], other, *(c for c in ranked[1:] if c is not other)]


def process_baseline_bytes(device: HardwareKind) -> int:
    """What a rank holds before any tensor of the model: on CPU, the RSS of a fresh
    interpreter that imported what a rank imports; on GPU 0 (the allocator's peak is the basis)."""
    if device is not HardwareKind.cpu:
        return 0
    code = (
        "import fsdp_lab.train.worker, torch.distributed\n"
        "for line in open('/proc/self/status'):\n"
        "    if line.startswith('VmHWM:'): print(int(line.split()[1]) * 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ConfigError(f"could not measure a rank's baseline memory: {proc.stderr[-300:]}")
    return int(proc.stdout.split()[-1])


def probe(
    overrides: list[str], c: Candidate, run_dir: Path, *, steps: int, budget: int, host: list[str]
) -> None:
    """A few steps of the candidate on the real ranks: its measured peak per rank, tokens/s
    and a verdict (fits, over budget, OOM, failed)."""
    args = [
        *overrides,
        *c.overrides(),
        *host,
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    c.run_dir = str(run_dir)
    proc = subprocess.run(
        [sys.executable, str(_train_py()), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    facts = rundir.read_run_file(run_dir)
    c.measured_bytes = facts.get("peak_mem_bytes")
    c.tokens_per_s = facts.get("median_tokens_per_s")
    if proc.returncode == 0:
        fits = c.measured_bytes is not None and c.measured_bytes <= budget
        c.verdict = "fits" if fits else "over budget"
        return
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    error = str(facts.get("error") or last.removeprefix("fsdp_lab: error: "))
    if "out of memory" in error.lower() or proc.returncode in (-9, 137):
        c.verdict = "OOM"
    else:
        c.verdict = f"failed: {error[:120]}"


def predicted_bytes(plan_peak: int, baseline: int) -> int:
    """A candidate's peak per rank on the budget's basis: the process's own, then the plan's
    tensors with its measured margin."""
    return baseline + int(SAFETY * plan_peak) + SLACK


def _predict(candidates: list[Candidate], baseline: int) -> None:
    for c in candidates:
        c.planned_bytes = predicted_bytes(c.plan_peak_bytes, baseline)


def _train_py() -> Path:
    return Path(__file__).resolve().parents[2] / "train.py"


def command(overrides: list[str], c: Candidate, host: list[str]) -> str:
    """The winner as one train.py command: the overrides (less the axes it sets), its own, and
    the host allocator's setting the probes ran with."""
    axes = {_key(o) for o in c.overrides()}
    kept = [o for o in overrides if _key(o) not in axes]
    return " ".join(["python", "train.py", *map(shlex.quote, [*kept, *c.overrides(), *host])])


# Long: tune's four stages in order, each a few lines.
def tune(
    overrides: list[str],
    memory_gib: float,
    *,
    out_dir: Path,
    probes: int = 3,
    steps: int = 6,
    max_micro_batch: int = 32,
    grid: Grid | None = None,
    log=print,
) -> TuneResult:
    """Enumerate, drop, probe, pick. ConfigError (exit 2) when nothing fits."""
    budget = int(memory_gib * GIB)
    candidates, device, world = enumerate_candidates(overrides, max_micro_batch, grid)
    if not candidates:
        raise ConfigError("no FSDP setup of these overrides is possible on this topology")
    _predict(candidates, 0)  # without the process's own memory: nothing fits already?
    if all(c.planned_bytes > budget for c in candidates):
        raise ConfigError(_nothing_fits(candidates, budget, world, device, "planned"))
    baseline = process_baseline_bytes(device)
    _predict(candidates, baseline)
    result = TuneResult(budget, baseline, candidates, grid is not None and grid.keep_global_batch)
    fitting = probe_order([c for c in candidates if c.planned_bytes <= budget])
    for c in candidates:
        if c.planned_bytes > budget:
            c.verdict = "dropped (plan)"
    if not fitting:
        raise ConfigError(_nothing_fits(candidates, budget, world, device, "planned"))
    asked = any(_key(o) == _key(MALLOC_OVERRIDE) for o in overrides)
    host = [MALLOC_OVERRIDE] if device is HardwareKind.cpu and not asked else []
    out_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"tune: {len(candidates)} candidates, {len(fitting)} fit {memory_gib:g} GiB per rank by "
        f"the plan (baseline {baseline / MIB:.0f} MiB + {SAFETY}x plan + {SLACK // MIB} MiB); "
        f"probing {min(probes, len(fitting))}, {steps} steps each"
    )
    probed: list[Candidate] = []
    for c in fitting:
        if len(probed) == probes:
            break
        if c.planned_bytes > budget:  # after a probe measured more than the plan's basis
            c.verdict = "dropped (plan + measured baseline)"
            continue
        probe(overrides, c, out_dir / f"probe-{len(probed)}", steps=steps, budget=budget, host=host)
        probed.append(c)
        mib = _mib(c.measured_bytes)
        log(f"  probe {len(probed) - 1}: {c.name}: {c.verdict}, {mib} MiB, {_tps(c)}")
        if c.measured_bytes is not None and c.measured_bytes - c.planned_bytes > 0:
            # the process holds more than the baseline guessed: raise it for the rest
            baseline += c.measured_bytes - c.planned_bytes
            result.baseline_bytes = baseline
            _predict(candidates, baseline)
    ok = [c for c in probed if c.verdict == "fits"]
    if probed and not ok and all(c.verdict.startswith("failed") for c in probed):
        # Not a memory answer: the runs themselves are refused (hardware, a setting).
        raise ConfigError(
            f"all {len(probed)} probe(s) failed before measuring anything; the first "
            f"({probed[0].run_dir}): {probed[0].verdict.removeprefix('failed: ')}"
        )
    if not ok:
        raise ConfigError(_nothing_fits(probed or fitting, budget, world, device, "measured"))
    result.winner = max(ok, key=lambda c: c.tokens_per_s or 0.0)
    result.command = command(overrides, result.winner, host)
    return result


def _nothing_fits(
    candidates: list[Candidate], budget: int, world: int, device: HardwareKind, basis: str
) -> str:
    key = "planned_bytes" if basis == "planned" else "measured_bytes"
    smallest = min(candidates, key=lambda c: getattr(c, key) or float("inf"))
    ways = ["more ranks (hardware.nproc_per_node / num_nodes: the state shards further)"]
    if device is not HardwareKind.cpu:
        ways.append("offload=cpu")
    ways += ["a shorter trainer.seq_len", "a smaller model, or a larger --memory-gib"]
    return (
        f"nothing fits in {budget / GIB:g} GiB per rank on {world} rank(s): the smallest "
        f"{basis} peak is {(getattr(smallest, key) or 0) / GIB:.2f} GiB ({smallest.name}); "
        f"try {', '.join(ways)}"
    )


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.0f}"


def _tps(c: Candidate) -> str:
    return "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f} tokens/s"


def format_table(result: TuneResult) -> str:
    rows = [("candidate", "planned MiB", "measured MiB", "tokens/s", "verdict")]
    order = sorted(result.candidates, key=lambda c: (c.measured_bytes is None, c.prior))
    for c in order:
        mark = "* " if c is result.winner else "  "
        rows.append(
            (
                mark + c.name,
                _mib(c.planned_bytes),
                _mib(c.measured_bytes),
                "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f}",
                c.verdict,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows)


def write_json(result: TuneResult, path: Path, overrides: list[str]) -> None:
    record = {
        "overrides": overrides,
        "budget_bytes": result.budget_bytes,
        "baseline_bytes": result.baseline_bytes,
        "safety": SAFETY,
        "slack_bytes": SLACK,
        "keep_global_batch": result.keep_global_batch,
        "winner": result.winner.name if result.winner else None,
        "command": result.command,
        "candidates": [
            {**dataclasses.asdict(c), "strategy": c.strategy.name, "name": c.name}
            for c in result.candidates
        ],
    }
    rundir.write_json(path, record)


def tune_command(
    overrides: list[str],
    memory_gib: float,
    *,
    out_dir: Path | None,
    probes: int,
    steps: int,
    max_micro_batch: int,
    grid: Grid | None = None,
) -> int:
    if memory_gib <= 0:
        raise ConfigError(f"--memory-gib {memory_gib}: give the budget per rank in GiB, > 0")
    if probes < 1 or steps < 3:
        raise ConfigError("--probes must be >= 1 and --steps >= 3 (tokens/s skips the first)")
    out_dir = out_dir or Path("outputs") / "tune" / time.strftime("%Y-%m-%d/%H-%M-%S")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} already holds files: pick a new --out")
    start = time.perf_counter()
    result = tune(
        overrides,
        memory_gib,
        out_dir=out_dir,
        probes=probes,
        steps=steps,
        max_micro_batch=max_micro_batch,
        grid=grid,
    )
    write_json(result, out_dir / "tune.json", overrides)
    print(format_table(result))
    w = result.winner
    print(
        f"\nfastest that fits {memory_gib:g} GiB per rank: {w.name} "
        f"({_tps(w)}, peak {_mib(w.measured_bytes)} MiB; tune took "
        f"{time.perf_counter() - start:.0f} s; {out_dir / 'tune.json'})"
    )
    print(result.command)
    return 0
