"""Planning: a config on a device -> a plan (``plan_config``). The memory plan (``memory``,
``activation_memory``, ``plan``, ``plan_result``), the time model (``op_count`` and
``plan_trace`` count a step's work, ``time_model`` and ``plan_time`` price it on a
``config.hardware_profiles.DeviceProfile``), this machine's measured profile (``calibrate``,
``calibrate_fit``, ``machine``, ``learn``), tune's grid and probes (``tune``), and the check of
a run against its plan (``run_check``). Above launch (tune probes runs), below the commands
(``fsdp_lab.tools``); the device rows are ``config.device_rows``, the micro-benchmarks
``engine.hardware.calibration``."""

from __future__ import annotations


def plan_config(overrides: list[str], device: str | None = None):
    """The plan of the run ``overrides`` compose (train.py's) on ``device`` (a named device,
    a profile file, or None: this machine's measured profile or the kind's row): every figure
    per rank and each strategy's predicted step (``plan_result.Plan``)."""
    from fsdp_lab.planning.plan import build_plan  # torch and transformers: on first use

    return build_plan(overrides, device)
