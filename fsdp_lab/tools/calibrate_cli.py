"""``fsdp-lab calibrate``'s command line (stdlib only at import: the CLI starts fast): measure
this machine (``planning.calibrate``), or refine a profile from runs already made
(``planning.learn``)."""

from __future__ import annotations

from pathlib import Path


def add_command(sub, name: str) -> None:
    """``fsdp-lab calibrate``'s arguments."""
    cal = sub.add_parser(
        name,
        help="measure this machine's matmuls, attention, memory, dispatch, collectives and "
        "copies at calibrate's own sizes into a hardware profile (runs, plan, tune read it)",
    )
    cal.add_argument("overrides", nargs="*", help="the ranks and dtype, as train.py's")
    cal.add_argument(
        "--out",
        type=Path,
        help="write the profile to this new file (default: this machine's cache, which runs, "
        "plan and tune read)",
    )
    cal.add_argument("--seconds", type=float, default=30.0, help="how long to measure in all (30)")
    cal.add_argument(
        "--base",
        help="the named device whose figures stand for what one node cannot measure (the "
        "network between nodes); default: the GPU this is, or cpu",
    )
    cal.add_argument(
        "--from-runs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="refine a profile from runs already made (their profile=trace split): the "
        "profile is --device's, else this machine's",
    )
    cal.add_argument("--device", help="with --from-runs: the profile to refine")


def command(args) -> int:
    if args.device and not args.from_runs:
        from fsdp_lab.config import ConfigError

        raise ConfigError(
            f"--device {args.device} names the profile --from-runs refines; measuring this "
            "machine starts from --base (or drop --device)"
        )
    if args.from_runs:
        from fsdp_lab.planning.learn import learn_command

        return learn_command(args.from_runs, args.out, device=args.device)
    from fsdp_lab.planning.calibrate import calibrate_command

    return calibrate_command(args.overrides, args.out, seconds=args.seconds, base=args.base)
