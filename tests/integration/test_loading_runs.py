"""Per-rank loading and streamed export (engine.loading, state.export) on real gloo ranks.

Each case runs tests/loading_ranks.py under torchrun: the worker's own build of the model, every
tensor a rank holds compared bitwise with transformers' from_pretrained (upcast to fp32), then
the streamed export compared with the checkpoint it came from. Measured on this machine (torch
2.13, transformers 5.24): every case bitwise equal; a 45M-parameter Llama (180 MB in fp32) on 4
ranks peaks at [501, 501, 501, 503] MB per rank while loading and [690, 622, 623, 625] MB while
exporting; rank 0's whole-model route (model.loading=rank0) at [700, 541, 544, 545] MB.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def save(path: Path, arch: str, *, shard: str = "100KB", **sizes) -> Path:
    """A bf16 checkpoint as save_pretrained writes it, in several files."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MixtralConfig

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=256,
        num_hidden_layers=2,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    common.update(sizes)
    config = {
        "llama": lambda: LlamaConfig(**common),
        "mixtral": lambda: MixtralConfig(
            **{**common, "intermediate_size": 96}, num_local_experts=4
        ),
        "gpt2": lambda: GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=256, bos_token_id=0, eos_token_id=1
        ),
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size=shard)
    return path


def ranks(out: Path, n: int, *overrides: str, export: Path | None = None, compare=True) -> list:
    """Each rank's facts (tests/loading_ranks.py), in rank order; fresh processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={n}", str(ROOT / "tests" / "loading_ranks.py")]
    cmd += ["--compare"] if compare else []
    cmd += ["--export", str(export)] if export else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(out), *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in glob.glob(str(directory / "*.safetensors")):
        out.update(load_file(file))
    return out


CASES = {  # name -> (arch, ranks, overrides)
    "llama-full-4": ("llama", 4, ("sharding=full",)),
    "gpt2-tied-hybrid-4": ("gpt2", 4, ("sharding=hybrid",)),
    # EP 2 x FSDP 2 and TP 2 x FSDP 2: the experts' and TP's shards split again by FSDP
    "mixtral-experts-ep2-4": ("mixtral", 4, ("parallel.expert=2",)),
    "llama-tp2-dp2": ("llama", 4, ("parallel.tensor=2",)),
    "llama-lora-offload-2": ("llama", 2, ("finetune=lora", "finetune.r=4", "offload=cpu")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_reads_its_own_shards_bitwise_and_the_export_is_the_checkpoint(name, tmp_path):
    arch, n, overrides = CASES[name]
    ckpt = save(tmp_path / "ckpt", arch)
    model = ("model=local", f"model.name_or_path={ckpt}")
    export = tmp_path / "export"
    facts = ranks(tmp_path / "out", n, *model, *overrides, export=export)
    for f in facts:
        assert f["checked"] > 0 and f["bad"] == [], f
    if "lora" in name:  # the adapters' directory: PEFT's own
        assert (export / "adapter_model.safetensors").is_file()
        assert len({f["fingerprint"] for f in facts}) == 1 and facts[0]["fingerprint"]
        return
    # The export holds the checkpoint's own keys (a Mixtral's one tensor per expert) and values.
    want, got = tensors(ckpt), tensors(export)
    assert set(got) == set(want)
    assert all(torch.equal(want[k].float(), got[k]) for k in want)
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(export).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    assert all(torch.equal(again[k], v) for k, v in reference.items())


def test_a_seed_draws_the_same_model_at_any_world_size_and_strategy(tmp_path):
    """Every rank's shards equal the same model drawn whole in one process (full_model)."""
    model = ("model.hidden_size=48", "model.num_layers=3", "finetune=lora", "finetune.r=2")
    for n, strategy in ((1, "full"), (2, "full"), (4, "hybrid")):
        for f in ranks(tmp_path / f"{n}-{strategy}", n, *model, f"sharding={strategy}"):
            assert f["checked"] > 0 and f["bad"] == [], (n, strategy, f)


def test_rank0_is_no_longer_special(tmp_path):
    """A model several times a rank's shard: per rank, the ranks' load and export peaks within
    15% of each other; rank 0's whole-model route (model.loading=rank0) is not, on the same
    checkpoint, and gives the same bits and the same fingerprint of the frozen base."""
    ckpt = save(
        tmp_path / "big",
        "llama",
        shard="40MB",
        num_hidden_layers=4,
        hidden_size=512,
        intermediate_size=1376,
        vocab_size=32000,
        num_key_value_heads=4,
    )
    model = ("model=local", f"model.name_or_path={ckpt}")
    per_rank = ranks(tmp_path / "per_rank", 4, *model, export=tmp_path / "e1")
    for what in ("load_rss", "export_rss"):
        peaks = [f[what] for f in per_rank]
        assert max(peaks) <= 1.15 * min(peaks), (what, peaks)
    whole = ranks(tmp_path / "rank0", 4, *model, "model.loading=rank0")
    peaks = [f["load_rss"] for f in whole]
    assert peaks[0] > 1.15 * max(peaks[1:]), peaks
    assert all(f["bad"] == [] for f in whole)
    lora = [
        ranks(tmp_path / f"lora-{r}", 2, *model, "finetune=lora", f"model.loading={r}")
        for r in ("per_rank", "rank0")
    ]
    assert {f["fingerprint"] for f in lora[0] + lora[1]} == {lora[0][0]["fingerprint"]}
    assert lora[0][0]["fingerprint"].startswith("files:")
