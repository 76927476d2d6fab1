"""hardware=tpu on XLA's CPU devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=2 or 4): each strategy
trains to the losses of a cpu (gloo) run of the same config, parameters are really sharded, and
checkpoints round-trip (also into a cpu run).

Needs torch_xla, which pins its own torch: ``make test-tpu`` builds that environment and runs
this file there. Elsewhere the module is skipped.

Tolerances, measured on this machine (torch 2.9.0, torch-xla 2.9.0, tiny Llama, synthetic data):
fp32 losses differ from the gloo run's by at most 7e-7 and gradient norms by 2e-7 relative;
bf16 (XLA autocast vs FSDP2's bf16 parameters) by at most 6e-5 in loss.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="hardware=tpu tests run in `make test-tpu`")

from conftest import check_ok, run_python, start_train
from conftest import train as train_py

pytestmark = pytest.mark.slow

COMMON = ("logger=none", "trainer.eval_every=2")
FP32_LOSS_TOL, FP32_NORM_RTOL, BF16_LOSS_TOL = 1e-5, 1e-5, 5e-4


def xla_env(devices: int) -> dict[str, str]:
    """hardware=tpu on ``devices`` XLA CPU devices."""
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}


def train(
    run_dir: Path, *overrides: str, devices: int | None = None, timeout: int = 400
) -> subprocess.CompletedProcess:
    """conftest's train.py run; ``devices``: hardware=tpu on that many XLA CPU devices."""
    if devices is None:
        return train_py(run_dir, *COMMON, *overrides, timeout=timeout)
    return train_py(
        run_dir, *COMMON, "hardware=tpu", *overrides, env=xla_env(devices), timeout=timeout
    )


def records(run_dir: Path) -> dict[tuple[str, int], dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[(r["split"], r["step"])] = r
    return out


def assert_same_run(
    xla: Path, gloo: Path, *, loss_tol: float, norm_rtol: float | None, extra: set = frozenset()
) -> None:
    """Every record of the gloo run, equal within the tolerances (``extra``: records only the
    XLA run has, such as the final evaluation of a run that was later resumed)."""
    a, b = records(xla), records(gloo)
    assert a.keys() - extra == b.keys()
    for key, rb in b.items():
        ra = a[key]
        if key[0] == "val":
            assert ra["val_loss"] == pytest.approx(rb["val_loss"], abs=loss_tol), key
            continue
        assert ra["loss"] == pytest.approx(rb["loss"], abs=loss_tol), key
        if norm_rtol is not None:
            assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=norm_rtol), key


def run_file(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


@pytest.fixture(scope="module")
def gloo(tmp_path_factory) -> dict[str, Path]:
    """The cpu (gloo, FSDP2) runs the XLA runs must reproduce, keyed by what they are."""
    root = tmp_path_factory.mktemp("gloo")
    runs = {
        "2": ("hardware.nproc_per_node=2", "trainer.max_steps=6"),  # the round trip's
        "4": ("hardware.nproc_per_node=4", "trainer.max_steps=4"),
        "2-bf16": ("hardware.nproc_per_node=2", "trainer.max_steps=4", "precision=bf16"),
    }
    for name, overrides in runs.items():
        check_ok(train(root / name, "hardware=cpu", *overrides))
    return {name: root / name for name in runs}


@pytest.mark.parametrize(
    "devices,strategy", [(4, "full"), (4, "hybrid"), (4, "no_shard"), (2, "no_shard")]
)
def test_strategy_matches_gloo(tmp_path, gloo, devices, strategy):
    """Each strategy on 4 devices and on 2 (there sharding=full is test_checkpoint_round_trip's
    run, and hybrid needs 4: rows of one device are refused)."""
    run = tmp_path / "run"
    steps = 4 if devices == 4 else 6
    check_ok(train(run, f"sharding={strategy}", f"trainer.max_steps={steps}", devices=devices))
    assert_same_run(run, gloo[str(devices)], loss_tol=FP32_LOSS_TOL, norm_rtol=FP32_NORM_RTOL)

    facts = run_file(run)
    assert facts["status"] == "completed" and facts["world_size"] == devices
    assert facts["hardware"].startswith(f"tpu: {devices} XLA devices")
    total, per_device = facts["total_params"], facts["local_params_per_rank"]
    assert len(per_device) == devices
    specs = facts["param_sharding"]
    matrices = [s for name, s in specs.items() if name.endswith("proj.weight")]
    # The parameters are really sharded: XLA's sharding annotation of every weight matrix, and
    # the elements each device holds.
    match strategy:
        case "full":
            assert facts["mesh_axes"] == ["fsdp"] and facts["mesh_shape"] == [devices]
            ids = ",".join(map(str, range(devices)))
            tiles = {f"{{devices=[{devices},1]{ids}}}", f"{{devices=[1,{devices}]{ids}}}"}
            assert all(s in tiles for s in matrices), matrices
            assert all(n == pytest.approx(total / devices, rel=0.01) for n in per_device)
        case "hybrid":  # rows of 2 devices share a shard; each device holds half
            assert facts["mesh_axes"] == ["replicate", "fsdp"] and facts["mesh_shape"] == [2, 2]
            assert all("last_tile_dim_replicate" in s for s in matrices), matrices
            assert all(n == pytest.approx(total / 2, rel=0.01) for n in per_device)
        case "no_shard":  # DDP: every device holds everything
            assert facts["mesh_shape"] == [devices, 1]
            assert all(n == total for n in per_device)
    state = facts["state_bytes_per_rank"]
    assert len(state) == devices
    expected = 4 * sum(per_device) / devices  # fp32
    for s in state:  # Adam's two moments are sharded like their parameters
        assert s["params"] == pytest.approx(expected, rel=0.01)
        assert s["optimizer"] == pytest.approx(2 * s["params"], rel=0.01)


def test_bf16_with_activation_checkpointing_matches_gloo(tmp_path, gloo):
    run = tmp_path / "run"
    check_ok(
        train(
            run, "precision=bf16", "activation_checkpointing=full", "trainer.max_steps=4", devices=2
        )
    )
    assert_same_run(run, gloo["2-bf16"], loss_tol=BF16_LOSS_TOL, norm_rtol=None)
    facts = run_file(run)
    assert facts["activation_checkpointing"] == [0, 1]


def test_tied_embeddings_stay_tied(tmp_path):
    """GPT-2 ties its output head to the input embedding. Moving a module to an XLA device gives
    each module a Parameter of its own: untied, the two copies train apart (the loss drifted by
    5e-4 after one step). Compared with the unsharded single-process reference."""
    from omegaconf import OmegaConf
    from reference import reference_run

    from fsdp_lab.config import to_typed

    run = tmp_path / "run"
    check_ok(train(run, "model=gpt2_tiny", "trainer.max_steps=3", devices=2))
    want, want_norms = reference_run(to_typed(OmegaConf.load(run / "config.yaml")), world_size=2)
    got = [r for key, r in sorted(records(run).items()) if key[0] == "train"]
    assert [r["loss"] for r in got] == pytest.approx(want, abs=FP32_LOSS_TOL)
    assert [r["grad_norm"] for r in got] == pytest.approx(want_norms, rel=FP32_NORM_RTOL)
    facts = run_file(run)
    assert sum(facts["local_params_per_rank"]) == facts["total_params"]  # one copy, sharded


def test_checkpoint_round_trip(tmp_path, gloo):
    """3 steps, then the same command to 6 steps resumes from the step-3 checkpoint: the losses
    are those of an uninterrupted gloo run. The checkpoint holds the plain parameter names, so a
    cpu run resumes from it too, and the Hugging Face export equals `fsdp-lab export` of it."""
    run = tmp_path / "run"
    check_ok(train(run, "trainer.max_steps=3", devices=2))
    ckpt = run / "checkpoints" / "step_00000003"
    marker = json.loads((ckpt / "COMPLETE.json").read_text())
    assert marker["format"] == "sharded" and (ckpt / ".metadata").is_file()
    assert not list((run / "checkpoints").glob("*.tmp"))
    proc = train(run, "trainer.max_steps=6", "checkpoint.export_hf=true", devices=2)
    check_ok(proc)
    assert "resuming" in proc.stderr + proc.stdout
    assert_same_run(
        run, gloo["2"], loss_tol=FP32_LOSS_TOL, norm_rtol=FP32_NORM_RTOL, extra={("val", 3)}
    )

    # The run's export (gathered from the devices) equals the final checkpoint's export, and
    # loads into transformers.
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = tmp_path / "exported"
    check_ok(run_python(["-m", "fsdp_lab.tools.cli", "export", str(run), str(exported)]))
    a = load_file(next((run / "hf").glob("*.safetensors")))
    b = load_file(next(exported.glob("*.safetensors")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        AutoModelForCausalLM.from_pretrained(run / "hf").num_parameters()
        == run_file(run)["total_params"]
    )

    on_cpu = tmp_path / "cpu"
    check_ok(
        train(
            on_cpu,
            "hardware=cpu",
            "hardware.nproc_per_node=2",
            f"resume={ckpt}",
            "trainer.max_steps=6",
        )
    )
    steps = {k: v for k, v in records(gloo["2"]).items() if k[1] > 3}
    resumed = records(on_cpu)
    assert resumed.keys() == steps.keys()
    for key, r in resumed.items():
        field = "val_loss" if key[0] == "val" else "loss"
        assert r[field] == pytest.approx(steps[key][field], abs=FP32_LOSS_TOL), key


def test_preemption_checkpoints_after_the_step(tmp_path):
    """SIGTERM to train.py reaches the one XLA process: it finishes the step, checkpoints and
    exits 75 (the cpu/gpu protocol), and the run dir says where it stopped."""
    run = tmp_path / "run"
    proc = start_train(run, *COMMON, "hardware=tpu", "trainer.max_steps=100000", env=xla_env(2))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 4):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr
    facts = run_file(run)
    assert facts["status"] == "preempted" and facts["step"] >= 3
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest == f"step_{facts['step']:08d}"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("sharding=grad_op",), "hardware=tpu cannot run sharding=grad_op"),
        (("offload=cpu",), "hardware=tpu cannot run offload=cpu"),
        (
            ("hardware.nproc_per_node=3",),
            "hardware.nproc_per_node=3 but this host has 2 XLA devices",
        ),
    ],
)
def test_refused_before_start(tmp_path, overrides, message):
    run = tmp_path / "run"
    proc = train(run, *overrides, devices=2, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert not (run / "checkpoints").exists()
