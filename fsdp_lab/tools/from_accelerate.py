"""`fsdp-lab from-accelerate`: an accelerate config file's FSDP setup as train.py overrides.

Reads the YAML `accelerate config` writes (``distributed_type: FSDP`` with an ``fsdp_config``
section, FSDP1 or FSDP2 spelling) and maps each documented key onto fsdp_lab's groups. Keys that
fsdp_lab always does (RAM-efficient loading, module-state sync, original params) are noted; the
FSDP1 prefetch knobs map onto ``sharding.prefetch``; keys with no equivalent (fp8, ...) become
warnings; launcher facts (IPs, ports, ranks) belong to torchrun/srun and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fsdp_lab.config import ConfigError

# accelerate's FSDP1 strategy names, in the order of their 1-based numbers (FSDP_SHARDING_STRATEGY).
STRATEGIES = {
    "FULL_SHARD": "full",
    "SHARD_GRAD_OP": "grad_op",
    "NO_SHARD": "no_shard",
    "HYBRID_SHARD": "hybrid",
    "HYBRID_SHARD_ZERO2": "hybrid_zero2",
}
WRAP = {"TRANSFORMER_BASED_WRAP": "transformer", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}
STATE_DICT = {
    "SHARDED_STATE_DICT": "sharded",
    "FULL_STATE_DICT": "full",
    "LOCAL_STATE_DICT": "sharded",
}
PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
ALWAYS = {
    "fsdp_cpu_ram_efficient_loading": "fsdp_lab always loads on rank 0 and broadcasts",
    "fsdp_sync_module_states": "rank 0's weights are always broadcast to every rank",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
    "fsdp_version": "fsdp_lab always uses FSDP2 (fully_shard)",
}
PREFETCH_KEYS = ("fsdp_backward_prefetch", "fsdp_forward_prefetch")
LAUNCHER = {
    "compute_environment",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "main_training_function",
    "gpu_ids",
    "debug",
    "enable_cpu_affinity",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "num_cpu_threads_per_process",
    "distributed_type",
    "fsdp_config",
    "num_processes",
    "num_machines",
    "mixed_precision",
    "use_cpu",
    "dynamo_config",
    "downcast_bf16",
}


@dataclass
class Translation:
    overrides: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # implied by fsdp_lab: nothing to set
    warnings: list[str] = field(default_factory=list)  # no equivalent: behaviour will differ


def _name(value, table: dict, key: str, numbered: bool = False) -> str:
    text = str(value).strip().upper()
    if numbered and text.isdigit() and 1 <= int(text) <= len(table):
        text = list(table)[int(text) - 1]
    if text not in table:
        raise ConfigError(f"{key}: {value!r} is not one of accelerate's {list(table)}")
    return table[text]


def _strategy(fsdp: dict, out: Translation) -> None:
    if "fsdp_sharding_strategy" in fsdp:  # the older spelling, a name or a 1-based number
        out.overrides.append(
            "sharding="
            + _name(
                fsdp["fsdp_sharding_strategy"], STRATEGIES, "fsdp_sharding_strategy", numbered=True
            )
        )
        return
    value = fsdp.get("fsdp_reshard_after_forward")
    if value is None:
        return
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):  # FSDP2 spelling
        reshard = value if isinstance(value, bool) else str(value).lower() == "true"
        out.overrides.append("sharding=full" if reshard else "sharding=grad_op")
    else:  # FSDP1 writes the strategy name under this key
        out.overrides.append(
            "sharding=" + _name(value, STRATEGIES, "fsdp_reshard_after_forward", numbered=True)
        )


def _wrap(fsdp: dict, out: Translation) -> None:
    if "fsdp_auto_wrap_policy" not in fsdp:
        return
    policy = _name(fsdp["fsdp_auto_wrap_policy"], WRAP, "fsdp_auto_wrap_policy")
    out.overrides.append(f"wrap={policy}")
    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if policy == "transformer" and classes:
        names = [c.strip() for c in str(classes).split(",") if c.strip()]
        out.overrides.append(f"wrap.classes=[{','.join(names)}]")
    if policy == "size" and fsdp.get("fsdp_min_num_params") is not None:
        out.overrides.append(f"wrap.min_num_params={int(fsdp['fsdp_min_num_params'])}")


def _prefetch(fsdp: dict, out: Translation) -> None:
    """FSDP1's prefetch knobs on FSDP2's explicit prefetching (sharding.prefetch): forward
    prefetching of the next unit; backward prefetching of the next unit is FSDP2's default
    (BACKWARD_PRE), which FSDP2 cannot turn off and has no post-gradient variant of."""
    if "fsdp_forward_prefetch" in fsdp:
        on = str(fsdp["fsdp_forward_prefetch"]).lower() in ("true", "1", "yes")
        out.overrides.append(f"sharding.prefetch.forward={1 if on else 0}")
    if "fsdp_backward_prefetch" not in fsdp:
        return
    value = str(fsdp["fsdp_backward_prefetch"]).upper()
    if value == "BACKWARD_PRE":
        out.notes.append(
            "fsdp_backward_prefetch=BACKWARD_PRE: FSDP2's default (sharding.prefetch.backward=1)"
        )
    elif value == "BACKWARD_POST":
        out.warnings.append(
            "fsdp_backward_prefetch=BACKWARD_POST: FSDP2 has no post-gradient "
            "prefetch; it gathers the next unit before the current one's "
            "gradients, as BACKWARD_PRE (sharding.prefetch.backward=1)"
        )
    elif value in ("NO_PREFETCH", "NONE", "FALSE"):
        out.warnings.append(
            f"fsdp_backward_prefetch={fsdp['fsdp_backward_prefetch']}: FSDP2 "
            "always prefetches the next unit in backward "
            "(sharding.prefetch.backward=1)"
        )
    else:
        raise ConfigError(
            f"fsdp_backward_prefetch: {fsdp['fsdp_backward_prefetch']!r} is not "
            "one of accelerate's ['BACKWARD_PRE', 'BACKWARD_POST', 'NO_PREFETCH']"
        )


def translate(config: dict) -> Translation:
    """The train.py overrides equivalent to an accelerate config (a parsed YAML mapping)."""
    kind = str(config.get("distributed_type", "")).upper()
    fsdp = config.get("fsdp_config")
    if kind != "FSDP" or not isinstance(fsdp, dict):
        raise ConfigError(
            f"distributed_type is {config.get('distributed_type')!r} with no "
            "fsdp_config section; give the file of an FSDP accelerate config"
        )
    out = Translation()
    _fsdp_section(fsdp, out)
    _launcher_section(config, out)
    return out


def _fsdp_section(fsdp: dict, out: Translation) -> None:
    """fsdp_config's keys, in the order accelerate's docs list them; unknown ones warned of."""
    _strategy(fsdp, out)
    _wrap(fsdp, out)
    if "fsdp_offload_params" in fsdp:
        out.overrides.append("offload=cpu" if fsdp["fsdp_offload_params"] else "offload=none")
    if "fsdp_state_dict_type" in fsdp:
        value = str(fsdp["fsdp_state_dict_type"]).upper()
        out.overrides.append("checkpoint=" + _name(value, STATE_DICT, "fsdp_state_dict_type"))
        if value == "LOCAL_STATE_DICT":
            out.warnings.append(
                "fsdp_state_dict_type=LOCAL_STATE_DICT: fsdp_lab writes DCP "
                "sharded checkpoints instead (loadable at any world size)"
            )
    if fsdp.get("fsdp_activation_checkpointing"):
        out.overrides.append("activation_checkpointing=full")
    _prefetch(fsdp, out)
    for key, why in ALWAYS.items():
        if key in fsdp:
            out.notes.append(f"{key}={fsdp[key]}: {why}")
    known = {
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_min_num_params",
        "fsdp_offload_params",
        "fsdp_state_dict_type",
        "fsdp_activation_checkpointing",
        *ALWAYS,
        *PREFETCH_KEYS,
    }
    out.warnings += [
        f"fsdp_config.{k}={v}: not known to fsdp_lab; ignored"
        for k, v in fsdp.items()
        if k not in known
    ]


def _launcher_section(config: dict, out: Translation) -> None:
    """The top-level keys: precision, devices, processes and machines, compilation."""
    precision = str(config.get("mixed_precision", "no")).lower()
    if precision in PRECISION:
        out.overrides.append(f"precision={PRECISION[precision]}")
    else:
        out.warnings.append(
            f"mixed_precision={precision}: no equivalent (fsdp_lab has fp32, "
            "bf16, bf16_pure, fp16); precision left at its default"
        )
    if config.get("use_cpu"):
        out.overrides.append("hardware=cpu")
    machines = int(config.get("num_machines", 1) or 1)
    if "num_processes" in config:  # accelerate counts every process of every machine
        total = int(config["num_processes"])
        if total % machines:
            raise ConfigError(f"num_processes={total} is not a multiple of num_machines={machines}")
        out.overrides.append(f"hardware.nproc_per_node={total // machines}")
    if machines > 1:
        out.overrides.append(f"hardware.num_nodes={machines}")
    dynamo = config.get("dynamo_config") or {}
    if str(dynamo.get("dynamo_backend", "NO")).upper() not in ("NO", "NONE"):
        out.overrides.append("compile=true")
    out.warnings += [f"{k}: not known to fsdp_lab; ignored" for k in config if k not in LAUNCHER]


def from_file(path: Path) -> Translation:
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read it as YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not an accelerate config (a YAML mapping)")
    return translate(config)
