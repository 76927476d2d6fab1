"""`fsdp-lab from-accelerate` on configs written the way `accelerate config` writes them."""

from __future__ import annotations

import shlex
import textwrap

import pytest
from conftest import ROOT
from hydra import compose, initialize_config_dir

from fsdp_lab.config import ConfigError, register_schema, to_typed
from fsdp_lab.tools.cli import main
from fsdp_lab.tools.from_accelerate import translate

CONF = ROOT / "conf"

FSDP1 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

FSDP2 = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_min_num_params: 100000000
  fsdp_offload_params: true
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_process_ip: 10.0.0.1
main_process_port: 29500
mixed_precision: fp16
num_machines: 2
num_processes: 16
use_cpu: false
"""


def run_cli(tmp_path, text: str, capsys) -> tuple[int, str, str]:
    path = tmp_path / "accelerate.yaml"
    path.write_text(textwrap.dedent(text))
    code = main(["from-accelerate", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def composes(overrides: list[str]):
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_typed(compose(config_name="config", overrides=overrides))


def test_fsdp1_config_becomes_train_py_overrides(tmp_path, capsys):
    code, out, err = run_cli(tmp_path, FSDP1, capsys)
    assert code == 0
    words = shlex.split(out.strip())
    assert words[:2] == ["fsdp-lab", "train"]
    assert words[2:] == [
        "sharding=full",
        "wrap=transformer",
        "wrap.classes=[LlamaDecoderLayer]",
        "offload=none",
        "checkpoint=sharded",
        "sharding.prefetch.forward=0",
        "precision=bf16",
        "hardware.nproc_per_node=8",
    ]
    assert "note: fsdp_backward_prefetch=BACKWARD_PRE: FSDP2's default" in err
    assert "warning" not in err
    assert "note: fsdp_cpu_ram_efficient_loading=True" in err
    cfg = composes(words[2:])  # what it prints is a valid fsdp_lab config
    assert cfg.wrap.classes == ["LlamaDecoderLayer"] and cfg.hardware.nproc_per_node == 8


def test_fsdp2_config_with_every_knob(tmp_path, capsys):
    code, out, err = run_cli(tmp_path, FSDP2, capsys)
    assert code == 0
    words = shlex.split(out.strip())
    assert words[0] == "torchrun"  # two machines: a multi-node launch
    overrides = [w for w in words if "=" in w and not w.startswith("--")]
    assert overrides == [
        "sharding=grad_op",
        "wrap=size",
        "wrap.min_num_params=100000000",
        "offload=cpu",
        "checkpoint=full",
        "activation_checkpointing=full",
        "precision=fp16",
        "hardware.nproc_per_node=8",
        "hardware.num_nodes=2",
    ]
    assert "fsdp_version=2: fsdp_lab always uses FSDP2" in err and "warning" not in err
    cfg = composes(overrides)
    assert cfg.offload.device.name == "cpu" and cfg.hardware.num_nodes == 2


@pytest.mark.parametrize(
    "fsdp,want",
    [
        ({"fsdp_sharding_strategy": 4}, "sharding=hybrid"),  # accelerate's 1-based numbers
        ({"fsdp_sharding_strategy": "5"}, "sharding=hybrid_zero2"),
        ({"fsdp_reshard_after_forward": "NO_SHARD"}, "sharding=no_shard"),  # FSDP1 under the v2 key
        ({"fsdp_reshard_after_forward": True}, "sharding=full"),
        ({"fsdp_auto_wrap_policy": "NO_WRAP"}, "wrap=none"),
        ({"fsdp_forward_prefetch": True}, "sharding.prefetch.forward=1"),
        ({"fsdp_forward_prefetch": "false"}, "sharding.prefetch.forward=0"),
    ],
)
def test_each_spelling_of_a_setting(fsdp, want):
    out = translate({"distributed_type": "FSDP", "fsdp_config": fsdp})
    assert want in out.overrides


@pytest.mark.parametrize(
    "value,fragment",
    [("BACKWARD_POST", "no post-gradient prefetch"), ("NO_PREFETCH", "always prefetches")],
)
def test_backward_prefetch_without_an_fsdp2_equivalent_is_warned_about(value, fragment):
    out = translate({"distributed_type": "FSDP", "fsdp_config": {"fsdp_backward_prefetch": value}})
    assert fragment in "\n".join(out.warnings)
    assert not any("prefetch" in o for o in out.overrides)


def test_keys_without_an_equivalent_are_warned_about():
    out = translate(
        {
            "distributed_type": "FSDP",
            "mixed_precision": "fp8",
            "new_key": 1,
            "fsdp_config": {
                "fsdp_sharding_strategy": "FULL_SHARD",
                "fsdp_foo": 3,
                "fsdp_state_dict_type": "LOCAL_STATE_DICT",
            },
        }
    )
    text = "\n".join(out.warnings)
    assert "mixed_precision=fp8: no equivalent" in text
    assert "fsdp_config.fsdp_foo=3: not known" in text and "new_key: not known" in text
    assert "LOCAL_STATE_DICT" in text and "checkpoint=sharded" in out.overrides


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("distributed_type: MULTI_GPU\nnum_processes: 2\n", "no fsdp_config section"),
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: ZERO3\n",
            "fsdp_sharding_strategy: 'ZERO3' is not one of",
        ),
        (
            "distributed_type: FSDP\nfsdp_config: {}\nnum_processes: 3\nnum_machines: 2\n",
            "num_processes=3 is not a multiple of num_machines=2",
        ),
        ("[not, a, mapping]\n", "not an accelerate config"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, capsys, text, fragment):
    code, out, err = run_cli(tmp_path, text, capsys)
    assert code == 2 and out == ""
    assert err.startswith("fsdp-lab: error:") and fragment in err and err.count("\n") == 1


def test_translate_rejects_a_missing_section():
    with pytest.raises(ConfigError):
        translate({"distributed_type": "FSDP"})
