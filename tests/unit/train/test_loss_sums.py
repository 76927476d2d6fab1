"""The training loss as a sum of token losses, and packed rows (several conversations in one
row, positions restarting at each) that attend only within their conversation, without the
host sync of transformers' packed-sequence check."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import model_with_loss
from test_loss import model_and_batch, tiny_config
from transformers import masking_utils

from fsdp_lab.config import LossConfig, LossKind, ModelTask
from fsdp_lab.engine import attention
from fsdp_lab.train import loss as loss_lib

IGNORE = loss_lib.IGNORE_INDEX
LENGTHS = (7, 5, 8)  # three conversations packed into one row of 20


def built(model_type: str, kind: LossKind, task=ModelTask.causal_lm):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    return model_with_loss(model, kind, task=task)


@pytest.mark.parametrize("kind", [LossKind.hf, LossKind.chunked])
def test_the_training_loss_is_the_sum_of_token_losses(kind):
    ref, batch = model_and_batch("llama")
    model, loss = model_with_loss(copy.deepcopy(ref), kind)
    count = (loss_lib.shifted_targets(batch["labels"]) != IGNORE).sum().item()
    got, want = loss(model, batch), ref(**batch).loss * count
    assert got.dtype == torch.float32 and count == 3 * 19 - 4
    assert abs(got.item() - want.item()) <= 1e-4 * count
    got.backward()
    want.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-6), name


def test_a_masked_lms_sum_counts_its_masked_positions():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(cfg).eval()
    ids = torch.randint(0, 300, (2, 16))
    labels = torch.full_like(ids, IGNORE)
    labels[0, 3], labels[1, 2:9] = ids[0, 3], ids[1, 2:9]  # 1 and 7 masked: no shift
    loss = loss_lib.Loss(kind=LossKind.hf, causal=False)
    got = loss(model, dict(input_ids=ids, labels=labels)).item()
    assert abs(got - model(input_ids=ids, labels=labels).loss.item() * 8) <= 1e-5


def packed(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One row of the conversations in ``LENGTHS``: positions restart at each, the sequence
    index is the restarts' cumulative sum (as the loader computes it), and a conversation's
    last token predicts nothing (its next token is the next conversation's first)."""
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    index = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
    labels[0, starts] = IGNORE  # shifted: the previous conversation's last position
    return dict(input_ids=ids, labels=labels, position_ids=positions, sequence_index=index)


def token_losses(model, loss, batch) -> list[float]:
    """Each target's loss through ``Loss``: one forward per target, the others IGNORE."""
    out, labels = [], batch["labels"]
    for t in range(1, labels.shape[1]):
        if labels[0, t] == IGNORE:
            continue
        one = torch.full_like(labels, IGNORE)
        one[0, t] = labels[0, t]
        with torch.no_grad():
            out.append(loss(model, {**batch, "labels": one}).item())
    return out


@pytest.mark.parametrize("model_type,kind", [("llama", LossKind.hf), ("gpt2", LossKind.chunked)])
def test_a_packed_row_is_its_conversations_run_alone(model_type, kind, monkeypatch):
    model, loss = built(model_type, kind)
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (1, sum(LENGTHS)))
    asked = []
    check = masking_utils.find_packed_sequence_indices

    def spy(position_ids):
        asked.append(1)
        return check(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    row = packed(ids)
    got = token_losses(model, loss, row)
    assert not asked  # the loader's index answered: transformers' check (a sync) never ran
    # ...with the same bits as transformers finding the sequences itself (its check, a sync)
    assert model.config._attn_implementation == "fsdp_lab_sdpa"
    with attention.transformers_masks(model):
        assert token_losses(model, loss, row) == got and asked
    assert masking_utils.find_packed_sequence_indices is spy  # never replaced
    # position_ids alone: the sequences found on the device, the same losses, no sync either
    asked.clear()
    without_index = {k: v for k, v in row.items() if k != "sequence_index"}
    assert token_losses(model, loss, without_index) == got and not asked
    want, start = [], 0
    for n in LENGTHS:
        alone = ids[:, start : start + n]
        want += token_losses(model, loss, dict(input_ids=alone, labels=alone))
        start += n
    assert len(got) == sum(LENGTHS) - len(LENGTHS)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
    # Conversation A's tokens changed: B's and C's losses are untouched (no attention across).
    other = ids.clone()
    other[0, : LENGTHS[0]] = (other[0, : LENGTHS[0]] + 1) % 300
    changed = token_losses(model, loss, packed(other))
    first = LENGTHS[0] - 1
    assert changed[first:] == pytest.approx(got[first:], abs=1e-6)
    assert max(abs(a - b) for a, b in zip(changed[:first], got[:first], strict=True)) > 1e-3
    # The test can fail: the same row without the packing attends across conversations.
    plain = token_losses(model, loss, {k: row[k] for k in ("input_ids", "labels")})
    assert max(abs(a - b) for a, b in zip(plain[first:], got[first:], strict=True)) > 1e-3


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_packed_sliding_window_layers_take_their_own_mask(model_type):
    # A window of 4 inside conversations of 5-8 tokens: Mistral's every layer slides (one
    # mask); Qwen2's first layer is full and its second slides (a mask per layer type).
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    config.sliding_window = 4
    if model_type == "qwen2":
        config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert len(attention.layer_kinds(model.config)) == (2 if model_type == "qwen2" else 1)
    loss = loss_lib.build_loss(
        LossConfig(kind=LossKind.hf), model, kind=LossKind.hf, task=ModelTask.causal_lm,
    )  # fmt: skip
    torch.manual_seed(1)
    row = packed(torch.randint(0, 300, (1, sum(LENGTHS))))
    got = token_losses(model, loss, row)
    # transformers finding the sequences itself (its check, a host sync): the same bits
    with attention.transformers_masks(model):
        assert token_losses(model, loss, row) == got
    config.sliding_window = 64  # the window no longer binds: another loss (the test can fail)
    assert token_losses(model, loss, row) != got


def test_z_loss_is_the_cross_entropy_plus_its_coefficient_times_log_z_squared():
    # A logit row of the loss table against a plain reference: PaLM's z-loss by hand.
    ref, batch = model_and_batch("llama")
    model = copy.deepcopy(ref)
    cfg = LossConfig(kind=LossKind.z_loss, z_loss_coef=0.01)
    loss = loss_lib.build_loss(cfg, model, kind=LossKind.z_loss, task=ModelTask.causal_lm)
    logits = ref(input_ids=batch["input_ids"]).logits.float().flatten(0, 1)
    targets = loss_lib.shifted_targets(batch["labels"]).flatten()
    learned = targets != IGNORE
    want = (
        torch.nn.functional.cross_entropy(logits[learned], targets[learned], reduction="sum")
        + 0.01 * torch.logsumexp(logits[learned], dim=-1).square().sum()
    )
    got = loss(model, batch)
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    got.backward()
    want.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-7), name
    # its term is there (the test can fail), and validation reports the cross-entropy alone
    plain = loss_lib.build_loss(
        LossConfig(kind=LossKind.hf), copy.deepcopy(ref), kind=LossKind.hf,
        task=ModelTask.causal_lm,
    )  # fmt: skip
    assert got.item() > plain(ref, batch).item() + 1.0
    assert loss.token_sums(model, batch)[0].item() == pytest.approx(
        plain.token_sums(ref, batch)[0].item(), rel=1e-6
    )
