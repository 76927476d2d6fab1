"""torchao's low precision through train.py: float8 training (1 rank vs 2 ranks full vs 4 ranks
hybrid, float8 all-gathers on; float8 against bf16 over 30 steps) and QLoRA (an NF4 base, 1 rank
vs 2 ranks full vs 4 ranks hybrid_zero2; its bytes per rank; a resume; the merged export).

The runs read packed token rows by their global index, with one row per micro-batch on every
rank: 1 rank accumulates 4 micro-batches where 4 ranks take one each, so every micro-batch
(and so every float8 activation scale, taken over one micro-batch) is the same at any world
size, and the weights' float8 scales come from whole tensors (FSDP2 all-gathers float8 with
a scale all-reduced over the shards).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import check_ok, run_python, train
from test_models import save_tiny

from fsdp_lab.config.low_precision import NF4_BYTES_PER_PARAM
from fsdp_lab.observe.run_logs import read_metrics
from fsdp_lab.planning import plan

pytestmark = pytest.mark.slow

pytest.importorskip("torchao")

EXACT = 1e-5  # relative, per step: what the issue asks of the world sizes
STEPS = 8


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def facts(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> tuple[str, ...]:
    root = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    eos = 255
    # Arithmetic progressions mod 250 (learnable in context, as data=synthetic's rows).
    docs = [
        np.append(
            2
            + (rng.integers(0, 250) + rng.integers(1, 9) * np.arange(rng.integers(20, 200))) % 250,
            eos,
        )
        for _ in range(600)
    ]
    np.concatenate(docs).astype(np.uint16).tofile(root / "train.bin")
    return (
        "data=tokens",
        f"data.files={root / 'train.bin'}",
        f"data.eos_id={eos}",
        f"data.cache_dir={root / 'cache'}",
        "trainer.seq_len=32",
        "trainer.micro_batch_size=1",
        "trainer.eval_every=0",
    )


def layout(world: int, strategy: str) -> tuple[str, ...]:
    return (
        f"hardware.nproc_per_node={world}",
        f"sharding={strategy}",
        f"trainer.grad_accum_steps={4 // world}",
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokens):
    """``runs(name, *overrides)``: a finished run's directory, run once per name."""
    done: dict[str, object] = {}

    def get(name: str, *overrides: str):
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            check_ok(train(run_dir, "hardware=cpu", *tokens, *overrides))
            done[name] = run_dir
        return done[name]

    return get


def relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


FLOAT8 = ("model=llama_tiny", "model.vocab_size=256", "precision=float8")


def test_float8_is_the_same_at_every_world_size_and_tracks_bf16(runs):
    one = runs("f8-1", *FLOAT8, *layout(1, "full"), "trainer.max_steps=30")
    two = runs("f8-2", *FLOAT8, *layout(2, "full"), f"trainer.max_steps={STEPS}")
    four = runs("f8-4", *FLOAT8, *layout(4, "hybrid"), f"trainer.max_steps={STEPS}")
    want = losses(one)[:STEPS]
    assert relative(losses(two), want) <= EXACT
    assert relative(losses(four), want) <= EXACT
    # Which layers are float8: the blocks' seven projections; the head stays bf16.
    record = facts(one)["low_precision"]
    assert record["scheme"] == "float8" and record["all_gather"] is True
    assert record["converted"] == 14 and "q_proj" in record["kinds"]
    assert record["layers"]["model.layers.*.mlp.down_proj"].startswith("float8 (tensorwise")
    assert record["layers"]["lm_head"].startswith("bf16: the output head")
    assert facts(four)["low_precision"]["layers"] == record["layers"]
    # Against bf16 on the same data: float8's rounding moves each step's loss by well under 1%.
    bf16 = runs("bf16-1", *FLOAT8, "precision=bf16", *layout(1, "full"), "trainer.max_steps=30")
    f8, b16 = losses(one), losses(bf16)
    assert relative(f8, b16) <= 0.005, relative(f8, b16)  # measured 9e-4
    assert f8[-1] < f8[0] - 0.3 and b16[-1] < b16[0] - 0.3  # both learned (5.56 -> 4.95)


@pytest.fixture(scope="module")
def nf4_base(tmp_path_factory):
    """A Llama whose projections split into whole NF4 scale blocks (16384 values) per shard."""
    path = tmp_path_factory.mktemp("nf4") / "base"
    save_tiny(
        path, hidden_size=256, intermediate_size=512, num_key_value_heads=4, num_hidden_layers=2
    )
    return path


def qlora(base) -> tuple[str, ...]:
    return (
        "model=local",
        f"model.name_or_path={base}",
        "finetune=qlora",
        "finetune.r=4",
        "precision=fp32",
        f"trainer.max_steps={STEPS}",
        "checkpoint.every_n_steps=4",
    )


def test_qlora_is_the_same_at_every_world_size_in_4_bits_per_rank(runs, nf4_base):
    one = runs("q-1", *qlora(nf4_base), *layout(1, "full"))
    two = runs("q-2", *qlora(nf4_base), *layout(2, "full"), "checkpoint.export_hf=true")
    four = runs("q-4", *qlora(nf4_base), *layout(4, "hybrid_zero2"))
    want = losses(one)
    assert relative(losses(two), want) <= EXACT
    assert relative(losses(four), want) <= EXACT
    # The log names the option chosen, and what its NF4 base holds on a rank.
    log = (two / "logs" / "rank0.log").read_text().splitlines()
    (line,) = [x for x in log if "finetune=" in x]
    assert "finetune=qlora: " in line and "the frozen base in NF4" in line, line
    # The base's quantised projections: 4 bits and their scales per parameter, over the
    # shard axis (2 ranks here and in 4 ranks hybrid), measured from each rank's shards. The
    # attention's 64x256 projections (16384 values, one scale block) cannot split over 2
    # ranks: every rank holds them whole, in 4 bits.
    attention = 2 * 4 * 64 * 256
    for run_dir, shards in ((one, 1), (two, 2), (four, 2)):
        record = facts(run_dir)["low_precision"]
        assert record["scheme"] == "nf4" and record["converted"] == 14
        assert record["params_whole_on_every_rank"] == (
            record["params"] if shards == 1 else attention
        )
        sharded = record["params"] - record["params_whole_on_every_rank"]
        per_rank = (sharded / shards + record["params_whole_on_every_rank"]) * NF4_BYTES_PER_PARAM
        tables = 14 * (16 + 1) * 4  # each tensor's lookup table and mean, in fp32
        for got in record["bytes_per_rank"]:
            assert per_rank <= got <= per_rank + tables, (got, per_rank)
        assert record["layers"]["lm_head"].startswith("not nf4: the output head")
    # And fsdp-lab plan predicted each rank's bytes exactly, NF4 shards included.
    for run_dir, world, strategy in ((two, 2, "full"), (four, 4, "hybrid_zero2")):
        args = ["hardware=cpu", *qlora(nf4_base), *layout(world, strategy)]
        want = plan.build_plan(args).to_json()
        want = want["strategies"][want["chosen"]]["per_rank"]
        for measured, planned in zip(facts(run_dir)["state_bytes_per_rank"], want, strict=True):
            assert measured == {k: planned[k] for k in measured}


def test_qlora_resumes_exactly_and_exports_the_run_s_own_model(runs, tokens, nf4_base, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = runs("q-2", *qlora(nf4_base), *layout(2, "full"), "checkpoint.export_hf=true")
    step4 = run_dir / "checkpoints" / "step_00000004"
    trainer = json.loads((step4 / "trainer.json").read_text())
    assert trainer["frozen_base"]["saved"] is False  # the checkpoint holds the adapters only
    resumed = tmp_path / "resumed"
    args = ("hardware=cpu", *qlora(nf4_base), *layout(2, "full"))
    check_ok(train(resumed, *tokens, *args, f"resume={step4}"))
    want = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}
    got = {r["step"]: r["loss"] for r in read_metrics(resumed / "metrics.jsonl")}
    assert got == {s: want[s] for s in range(5, STEPS + 1)}

    # The merged export: the dequantised base with the adapters merged, in the base's dtype,
    # gives the run's own model's logits.
    merged = tmp_path / "merged"
    cli = ["-m", "fsdp_lab.tools.cli", "export", str(run_dir), str(merged), "--merge"]
    check_ok(run_python(cli))
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert not any("lora" in k for k in model.state_dict())
    ids = torch.randint(3, 255, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, _own_logits(run_dir, ids), rtol=1e-5, atol=1e-5)
    # And PEFT's adapter beside it (checkpoint.export_hf=true), for the unquantised base.
    assert (run_dir / "hf" / "adapter_model.safetensors").is_file()


def _own_logits(run_dir, ids) -> torch.Tensor:
    """The trained model as the run computed it, rebuilt in one process: the base from its
    files, each projection quantised whole by torchao's own ``to_nf4`` and dequantised, the
    checkpoint's adapters on top (not merged)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import AutoModelForCausalLM

    from fsdp_lab.engine import finetune
    from fsdp_lab.state.export_source import load_checkpoint_weights

    sd, _, cfg = load_checkpoint_weights(run_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
    finetune.apply(model, cfg.finetune)
    adapters = {k: v for k, v in sd.items() if ".lora_" in k}  # the base: from its files
    assert not model.load_state_dict(adapters, strict=False).unexpected_keys
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = name.removesuffix(".base_layer").rsplit(".", 1)[-1]
            if type(module) is torch.nn.Linear and ".lora_" not in name and kind in kinds:
                module.weight.copy_(to_nf4(module.weight).get_original_weight())
        return model.eval()(input_ids=ids).logits
