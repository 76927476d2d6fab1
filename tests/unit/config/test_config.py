"""Every option of every config group composes into a valid typed config; bad values fail."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from fsdp_lab.config import (
    Config,
    ConfigError,
    Dtype,
    HardwareKind,
    LossKind,
    OptimImpl,
    ShardingStrategy,
    register_schema,
    rules,
    to_container,
    to_typed,
)
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.rules import validate
from fsdp_lab.config.strategies import reshard_after_forward, strategy_of
from fsdp_lab.config.topology import Topology, mesh_shape
from fsdp_lab.observe.trackers.base import flatten

CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
# Options that need a value the user must supply (marked ??? in their YAML).
REQUIRED = {
    ("model", "local"): ["model.name_or_path={tiny_model_dir}"],
    ("data", "text"): ["data.files=[corpus.txt]"],
    ("data", "hub"): ["data.name=roneneldan/TinyStories"],
    ("data", "tokens"): ["data.files=[train.bin]", "model.vocab_size=50304"],
    ("data", "chat"): ["data.files=[chats.jsonl]"],
    ("finetune", "freeze"): ["finetune.freeze_blocks=1"],  # what to freeze is the user's
    # Its model is converted once by scripts/prepare_smollm2.py; a stand-in directory here.
    ("experiment", "smollm2_shakespeare"): ["model.name_or_path={tiny_model_dir}"],
}

register_schema()


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_groups_are_the_documented_ones():
    assert {
        "sharding",
        "precision",
        "wrap",
        "offload",
        "hardware",
        "model",
        "data",
        "optim",
        "trainer",
        "checkpoint",
        "activation_checkpointing",
        "loss",
        "finetune",
    } <= set(GROUPS)
    assert {o for g, o in OPTIONS if g == "loss"} == {k.value for k in LossKind}
    assert {o for g, o in OPTIONS if g == "sharding"} == {s.value for s in ShardingStrategy}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_types(group, option, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    extra = [o.format(tiny_model_dir=model_dir) for o in REQUIRED.get((group, option), [])]
    cfg = to_typed(compose_cfg(f"{group}={option}", *extra))
    # Every value the option's YAML sets reaches the typed config unchanged.
    typed = flatten(to_container(cfg))
    yaml = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
    yaml.pop("defaults", None)
    global_package = (CONF / group / f"{option}.yaml").read_text().startswith("# @package _global_")
    overridden = {o.split("=")[0] for o in extra}
    for key, value in flatten(yaml if global_package else {group: yaml}).items():
        if (
            key in overridden
            or key.startswith("hydra.")  # Hydra's own settings (hparams_search's sweeper)
            or (isinstance(value, str) and (value.startswith("${") or value == "???"))
        ):
            continue  # an interpolation (Hydra resolves it), or a value the user must supply
        assert typed[key] == value, f"{group}={option}: {key} is {typed[key]!r}, YAML {value!r}"


def test_the_default_composition_is_the_schemas_defaults():
    """One source of truth: the default options' YAML restates no default differently from the
    schema. Only what picking an option means differs: the preset's arch, the CPU ranks."""
    composed = flatten(to_container(to_typed(compose_cfg("hardware=cpu"))))
    schema = flatten(to_container(Config()))
    differs = {
        k: (composed.get(k), schema.get(k))
        for k in composed.keys() | schema.keys()
        if composed.get(k) != schema.get(k)
        and not k.startswith("logger.")  # a tracker's defaults are its Settings' (test_trackers)
    }
    assert differs == {
        "model.arch": ("llama", None),  # model=llama_tiny, the default preset
        "hardware.kind": ("cpu", "auto"),  # the override above
        "hardware.nproc_per_node": (2, None),  # hardware=cpu: 2 ranks
    }


def test_group_options_map_to_their_enum():
    assert to_typed(compose_cfg("sharding=hybrid_zero2")).sharding.strategy is (
        ShardingStrategy.hybrid_zero2
    )
    p = to_typed(compose_cfg("precision=bf16")).precision
    assert (p.param_dtype, p.reduce_dtype, p.grad_scaler_enabled) == (Dtype.bf16, Dtype.fp32, False)
    p = to_typed(compose_cfg("precision=bf16_pure")).precision
    assert (p.param_dtype, p.reduce_dtype) == (Dtype.bf16, Dtype.bf16)
    p = to_typed(compose_cfg("precision=fp16")).precision
    assert (p.param_dtype, p.reduce_dtype, p.grad_scaler_enabled) == (Dtype.fp16, Dtype.fp32, True)


def test_speed_settings_compose_with_their_defaults():
    cfg = to_typed(compose_cfg())
    assert (cfg.loss.kind, cfg.loss.chunk_size) == (LossKind.auto, None)
    assert cfg.optim.implementation is OptimImpl.auto and cfg.trainer.log_every == 10
    assert (cfg.sharding.prefetch.forward, cfg.sharding.prefetch.backward) == (0, 1)
    assert cfg.precision.tf32 is True
    cfg = to_typed(
        compose_cfg(
            "loss=chunked",
            "loss.chunk_size=512",
            "trainer.log_every=1",
            "optim.implementation=for_loop",
            "sharding.prefetch.forward=2",
            "sharding.prefetch.backward=3",
            "precision.tf32=false",
        )
    )
    assert (cfg.loss.kind, cfg.loss.chunk_size, cfg.trainer.log_every) == (LossKind.chunked, 512, 1)
    assert cfg.optim.implementation is OptimImpl.for_loop and not cfg.precision.tf32
    assert (cfg.sharding.prefetch.forward, cfg.sharding.prefetch.backward) == (2, 3)


def test_unknown_option_fails_listing_the_valid_ones():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("sharding=zero3")
    message = str(e.value)
    assert "sharding/zero3" in message
    assert all(option in message for option in ("grad_op", "no_shard", "hybrid_zero2"))


@pytest.mark.parametrize(
    "override",
    [
        "trainer.max_step=3",
        "sharding.strategy=zero3",
        "trainer.seq_len=abc",
        "precision.param_dtype=fp8",
    ],
)
def test_typos_and_wrong_types_fail_at_compose(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)):
        compose_cfg(override)


def topo(world: int, nodes: int = 1) -> Topology:
    return Topology(
        world_size=world, nproc_per_node=world // nodes, num_nodes=nodes, device=HardwareKind.cpu
    )


@pytest.mark.parametrize(
    "overrides,world,fragment",
    [
        (["trainer.seq_len=0"], 2, "trainer.seq_len"),
        (["trainer.micro_batch_size=-1"], 2, "trainer.micro_batch_size"),
        (["trainer.max_steps=0"], 2, "trainer.max_steps"),
        (["hardware.nproc_per_node=0"], 2, "hardware.nproc_per_node"),
        (["model.num_heads=3"], 2, "model.num_heads"),
        (["precision.param_dtype=fp16"], 2, "grad_scaler_enabled"),
        (["sharding.reshard_after_forward=1"], 2, "reshard_after_forward"),
        (["sharding.reshard_after_forward=maybe"], 2, "reshard_after_forward"),
        (["model.arch=null"], 2, "model.arch"),
        (["seed=-1"], 2, "seed"),
        (["trainer.seq_len=1"], 2, "trainer.seq_len"),
        (["model.hidden_size=12", "model.num_heads=4"], 2, "must be even"),
        (["optim.beta1=1.5"], 2, "optim.beta1"),
        (["optim.eps=-1"], 2, "optim.eps"),
        (["checkpoint=full", "checkpoint.async_enabled=true"], 2, "checkpoint=sharded"),
        (["checkpoint.keep_last=0"], 2, "checkpoint.keep_last"),
        (["model=local", "model.name_or_path=/nonexistent"], 2, "config.json"),
        (["sharding=hybrid"], 2, "shard groups of 1"),
        (["sharding=hybrid", "sharding.replicate_size=3"], 4, "does not divide"),
        (["sharding=full", "sharding.replicate_size=2"], 4, "only to sharding=hybrid"),
        (["sharding=full", "sharding.reshard_after_forward=3"], 4, "divisor"),
        (["trainer.log_every=0"], 2, "trainer.log_every=0 must be > 0"),
        (["loss.chunk_size=-4"], 2, "loss.chunk_size=-4 must be > 0"),
        (["sharding.prefetch.forward=-1"], 2, "sharding.prefetch.forward=-1 must be >= 0"),
        (["sharding.prefetch.backward=0"], 2, "FSDP2 always prefetches the next unit"),
        (["data=tokens", "data.files=[a.bin]"], 2, "model.vocab_size is null"),
        (["data=text", "data.files=[a.txt]", "data.streaming=true"], 2, "streams a hub dataset"),
        (["data=hub", "data.name=x", "data.max_tokens=100"], 2, "data.max_tokens applies to"),
        (["data.num_proc=0"], 2, "data.num_proc=0 must be > 0"),
        (["data.eos_id=-1"], 2, "data.eos_id=-1 must be a token id"),
    ],
)
def test_bad_values_fail_naming_the_setting(overrides, world, fragment):
    with pytest.raises(ConfigError) as e:
        validate(to_typed(compose_cfg(*overrides)), topo(world))
    message = str(e.value)
    assert fragment in message and "\n" not in message


def test_hybrid_replicate_size_defaults():
    cfg = to_typed(compose_cfg("sharding=hybrid"))
    assert mesh_shape(cfg.sharding, topo(4)) == (2, 2)  # one node: 2 replicas
    assert mesh_shape(cfg.sharding, topo(16, nodes=4)) == (4, 4)  # a replica per node
    validate(cfg, topo(16, nodes=4))
    cfg = to_typed(compose_cfg("sharding=hybrid", "sharding.replicate_size=4"))
    validate(cfg, topo(8))
    assert mesh_shape(cfg.sharding, topo(8)) == (4, 2)


@pytest.mark.parametrize(
    "override,world,want",
    [("false", 2, False), ("true", 2, True), ("2", 8, 2), ("null", 2, True)],
)
def test_reshard_after_forward_accepts_bool_and_divisor(override, world, want):
    cfg = to_typed(compose_cfg(f"sharding.reshard_after_forward={override}"))
    validate(cfg, topo(world))
    assert reshard_after_forward(cfg.sharding) == want
    assert type(reshard_after_forward(cfg.sharding)) is type(want)


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["sharding=grad_op"], "use sharding=full (for grad_op)"),
        (["sharding=hybrid_zero2"], "sharding=hybrid (for hybrid_zero2)"),
        (["sharding.reshard_after_forward=false"], "sharding.reshard_after_forward"),
        (["offload=cpu"], "offload=cpu"),
        (["precision=fp16"], "precision=fp16"),
        (["precision=bf16_pure"], "precision.reduce_dtype=bf16"),
        (["precision=bf16", "precision.output_dtype=fp32"], "precision.output_dtype"),
        (["compile=true"], "compile=true"),
        (["checkpoint=full"], "checkpoint=full"),
        (["checkpoint.async_enabled=true"], "checkpoint.async_enabled"),
        (["hardware.num_nodes=2"], "multi-host"),
        (["loss=chunked"], "use loss=hf"),
        (["optim.implementation=fused"], "optim.implementation=foreach"),
        (["sharding.prefetch.forward=1"], "sharding.prefetch"),
    ],
)
def test_tpu_refuses_what_xla_cannot_honour(overrides, fragment):
    """Checked with the topology, before any process starts: one line naming setting and fix."""
    tpu = Topology(world_size=4, nproc_per_node=4, num_nodes=1, device=HardwareKind.tpu)
    with pytest.raises(ConfigError) as e:
        validate(to_typed(compose_cfg("hardware=tpu", *overrides)), tpu)
    message = str(e.value)
    assert message.startswith("hardware=tpu cannot run") and fragment in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["sharding=hybrid"],
        ["sharding=no_shard"],
        ["precision=bf16", "activation_checkpointing=full"],
    ],
)
def test_tpu_accepts_what_xla_maps(overrides):
    tpu = Topology(world_size=4, nproc_per_node=4, num_nodes=1, device=HardwareKind.tpu)
    cfg = to_typed(compose_cfg("hardware=tpu", *overrides))
    assert strategy_of(cfg.sharding.strategy).xla is cfg.sharding.strategy  # XLA runs it as is
    row = hardware_row(HardwareKind.tpu)
    assert not [setting for feature, setting in rules.asked(cfg) if not row.runs(feature)]
    validate(cfg, tpu)  # and nothing else refuses it


def test_one_data_file_needs_no_brackets():
    one = to_typed(compose_cfg("data=text", "data.files=corpus.txt")).data.files
    assert one == ["corpus.txt"]
    assert to_typed(compose_cfg("data=text", "data.files=[a.txt,b.txt]")).data.files == [
        "a.txt",
        "b.txt",
    ]
    with pytest.raises(ConfigError, match=r"data\.files=3 must be a path or a list of paths"):
        to_typed(compose_cfg("data=text", "data.files=3"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.max_new_tokens=0", "eval.max_new_tokens=0 must be"),
        ("eval.temperature=-1", "eval.temperature=-1.0 must be >= 0"),
        ("eval.top_p=0", "eval.top_p=0.0 must be in"),
        ("eval.harness_every=-2", "eval.harness_every=-2 must be >= 0"),
        ("eval.harness_include_path=tasks", "eval.harness_tasks is empty"),
        (
            "eval.prompts=[hi] parallel.sequence_parallel=true",
            "set parallel.sequence_parallel=false",
        ),
    ],
)
def test_bad_eval_fields_are_one_line(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        to_typed(compose_cfg(*override.split()))
