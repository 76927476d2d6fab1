"""Packed rows on a device (python packing_per_token.py cuda): each conversation's per-token
losses through fsdp_lab's summed loss equal the same conversation run alone, for loss=hf and
chunked, fp32 and bf16 (SDPA); the same row without the packing differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit" / "train")]

from test_loss import tiny_config  # noqa: E402  (the loss tests' 2-layer models)
from test_loss_sums import token_losses  # noqa: E402  (one forward per target)

from fsdp_lab.config import LossConfig, LossKind, ModelTask  # noqa: E402
from fsdp_lab.train import loss as loss_lib  # noqa: E402

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
IGNORE = loss_lib.IGNORE_INDEX
LENGTHS = (37, 21, 70)  # three conversations in one row


results = {}
for dtype in (torch.float32, torch.bfloat16):
    for kind in (LossKind.hf, LossKind.chunked):
        torch.manual_seed(0)
        cfg = tiny_config("llama")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        model = model.to(DEVICE, dtype).eval()
        loss = loss_lib.build_loss(
            LossConfig(kind=kind), model, kind=kind, task=ModelTask.causal_lm, compiled=False
        )
        torch.manual_seed(1)
        ids = torch.randint(0, 300, (1, sum(LENGTHS)), device=DEVICE)
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(DEVICE)
        index = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None].to(DEVICE)
        labels = ids.clone()
        labels[0, torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)] = IGNORE
        packed = dict(input_ids=ids, labels=labels, position_ids=positions, sequence_index=index)
        got = token_losses(model, loss, packed)
        alone, start = [], 0
        for n in LENGTHS:
            part = ids[:, start : start + n]
            alone += token_losses(model, loss, dict(input_ids=part, labels=part.clone()))
            start += n
        plain = token_losses(model, loss, dict(input_ids=ids, labels=labels))
        first = LENGTHS[0] - 1
        key = f"{str(dtype).removeprefix('torch.')}/{kind.value}"
        results[key] = {
            "tokens": len(got),
            "max_diff_vs_alone": max(abs(a - b) for a, b in zip(got, alone, strict=True)),
            "unpacked_differs_by": max(
                abs(a - b) for a, b in zip(plain[first:], got[first:], strict=True)
            ),
        }
        print(key, results[key], flush=True)
print("PACKING_JSON " + json.dumps(results))
