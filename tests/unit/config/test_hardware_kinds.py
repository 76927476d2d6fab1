"""The hardware table: a row per kind, every refusal a feature some setting asks for, what
reads the rows following them, and no other module naming a kind."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import assert_only_named_in

from fsdp_lab.config import ConfigError, HardwareKind, StartMethod, compose
from fsdp_lab.config import hardware_kinds as hk
from fsdp_lab.config.hardware_kinds import HARDWARE, Feature, hardware_row, resolved
from fsdp_lab.config.rules import asked, validate
from fsdp_lab.config.topology import Topology


def test_every_kind_but_auto_has_one_row():
    assert set(HARDWARE) == set(HardwareKind) - {HardwareKind.auto}
    with pytest.raises(RuntimeError, match="auto is resolved first"):
        hardware_row(HardwareKind.auto)
    assert resolved(HardwareKind.auto, cuda=True) is HardwareKind.gpu
    assert resolved(HardwareKind.auto, cuda=False) is HardwareKind.cpu
    assert resolved(HardwareKind.tpu, cuda=True) is HardwareKind.tpu


# One config asking for each feature: the rules must see every feature a row can refuse.
ASKING = {
    Feature.strategy_regathers: ["sharding=grad_op"],
    Feature.reshard_after_forward: ["sharding.reshard_after_forward=false"],
    Feature.prefetch: ["sharding.prefetch.forward=1"],
    Feature.offload: ["offload=cpu"],
    Feature.op_checkpointing: ["activation_checkpointing=op"],
    Feature.scaled_dtype: ["precision=fp16"],
    Feature.grad_scaler: ["precision=bf16", "precision.grad_scaler_enabled=true"],
    Feature.half_reduce: ["precision=bf16_pure"],
    Feature.output_dtype: ["precision=bf16", "precision.output_dtype=fp32"],
    Feature.compile: ["compile=true"],
    Feature.generation: ["eval.prompts=[hello]"],
    Feature.fused_optimizer: ["optim.implementation=fused"],
    Feature.custom_loss: ["loss=chunked"],
    Feature.triton: ["loss=liger"],
    Feature.whole_file_checkpoints: ["checkpoint=full"],
    Feature.async_checkpoints: ["checkpoint.async_enabled=true"],
    Feature.frozen_parameters: ["finetune=lora"],
    Feature.multi_host: ["hardware.num_nodes=2"],
    Feature.tensor_parallel: ["parallel.tensor=2"],
    Feature.context_parallel: ["parallel.context=2"],
    Feature.expert_parallel: ["model=olmoe_tiny", "parallel.expert=2"],
    Feature.torchao: ["precision=bf16", "precision.float8_recipe=tensorwise"],
    Feature.grouped_mm: ["model=olmoe_tiny", "model.experts_implementation=grouped_mm"],
    Feature.pipeline_parallel: ["parallel.pipeline=2"],
}
LAUNCHED = {Feature.external_launch}  # asked by how the ranks start, not by a setting


def test_every_feature_is_asked_by_a_setting_and_the_default_asks_none():
    assert set(ASKING) | LAUNCHED == set(Feature)
    assert asked(compose(["hardware=tpu"])) == []
    for feature, overrides in ASKING.items():
        features = [f for f, _ in asked(compose(overrides))]
        assert feature in features, (feature, overrides, features)


@pytest.mark.parametrize("feature", sorted(ASKING, key=lambda f: f.value))
def test_a_refused_feature_is_one_line_naming_kind_setting_and_fix(feature):
    """Each refusal of the tpu row, and on a row that refuses nothing the same config passes
    the table's check (the other rules may still say no)."""
    tpu = Topology.nodes(4, 1, HardwareKind.tpu)
    cfg = compose(["hardware=tpu", *ASKING[feature]])
    with pytest.raises(ConfigError) as e:
        validate(cfg, tpu)
    message = str(e.value)
    assert message.startswith("hardware=tpu cannot run ") and "\n" not in message
    reason = hardware_row(HardwareKind.tpu).refuses[next(f for f, _ in asked(cfg))]
    assert message.endswith(reason)


def test_what_reads_the_rows_follows_them(monkeypatch):
    """A throwaway change to a row moves the rules, the launcher and the engines' choices."""
    from fsdp_lab.engine.hardware import devices, process_group
    from fsdp_lab.launch import local
    from fsdp_lab.train import optim

    cpu = Topology.nodes(2, 1, HardwareKind.cpu)
    validate(compose(["hardware=cpu", "offload=cpu"]), cpu)
    opt = compose(["hardware=cpu"]).optim
    assert optim.resolve_implementation(opt, HardwareKind.cpu, grad_scaler=False).name == "fused"
    assert local.resolve_start_method(StartMethod.auto, HardwareKind.cpu) is StartMethod.fork
    assert process_group.backend(HardwareKind.cpu) == "gloo"
    row = HARDWARE[HardwareKind.cpu]
    changed = dataclasses.replace(
        row,
        start_method=StartMethod.spawn,
        nccl=True,
        default_ranks=3,
        refuses={
            Feature.offload: "no host to offload to; use offload=none",
            Feature.fused_optimizer: "no fused kernel; use optim.implementation=foreach",
        },
    )
    monkeypatch.setitem(hk.HARDWARE, HardwareKind.cpu, changed)
    with pytest.raises(ConfigError, match=r"^hardware=cpu cannot run offload=cpu: no host"):
        validate(compose(["hardware=cpu", "offload=cpu"]), cpu)
    assert local.resolve_start_method(StartMethod.auto, HardwareKind.cpu) is StartMethod.spawn
    assert process_group.backend(HardwareKind.cpu) == "cuda:nccl,cpu:gloo"
    assert devices.default_nproc_per_node(HardwareKind.cpu) == 3
    assert optim.resolve_implementation(opt, HardwareKind.cpu, grad_scaler=False).name == "foreach"


NAMED = re.compile(r"\bHardwareKind\.(cpu|gpu|tpu)\b")


def test_no_other_module_names_a_hardware_kind():
    # The schema names the default (auto); the table holds each kind's row.
    allowed = {"config/hardware.py", "config/hardware_kinds.py"}
    seen = ["if kind is HardwareKind.tpu:", "kind = HardwareKind.gpu if cuda else ..."]
    assert_only_named_in(allowed, NAMED, seen, "hardware kind dispatch outside its table")


def test_a_runs_hardware_line_gives_its_kind_where_the_plan_prices_it():
    from types import SimpleNamespace

    from fsdp_lab.planning import run_check

    def facts(line):
        return SimpleNamespace(hardware=line, world_size=4, num_nodes=2)

    cpu = run_check.run_topology(facts("cpu: 2 cores"))
    assert (cpu.device, cpu.nproc_per_node, cpu.num_nodes) == (HardwareKind.cpu, 2, 2)
    assert run_check.run_topology(facts("gpu: 8 x NVIDIA H100")).device is HardwareKind.gpu
    assert run_check.run_topology(facts("tpu: 4 XLA devices")) is None  # the plan refuses it
    assert run_check.run_topology(facts("npu: 1 x ?")) is None
