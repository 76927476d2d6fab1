"""Lockstep generation on one process: greedy tokens equal transformers' generate whatever the
batching (left padding, a short last batch), sampling depends on the prompt alone, a stop
check ends a row, and a prompt is cut to leave room for the new tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from fsdp_lab.train.generate import Lockstep, Request, Sampling, fit_prompt, generate

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20], [30, 31, 32]]
EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def model():
    return tiny_llama(use_cache=False).eval()  # use_cache: as fsdp_lab builds it for training


def run(model, sampling, batch_size, prompts=PROMPTS, stop=None):
    requests = [Request(i, p) for i, p in enumerate(prompts)]
    return generate(
        model,
        requests,
        sampling,
        lock=Lockstep(),
        batch_size=batch_size,
        eos_ids={EOS},
        pad_id=PAD,
        stop=stop,
    )


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_greedy_equals_generate(model, batch_size):
    got = run(model, Sampling(8), batch_size)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )[0, len(prompt) :].tolist()
        assert tokens == (ref[: ref.index(EOS)] if EOS in ref else ref)


def test_sampling_depends_on_the_prompt_and_seed_only(model):
    sampling = Sampling(8, temperature=1.0, top_p=0.9, seed=3)
    whole = run(model, sampling, 2)
    assert whole == run(model, sampling, 5)  # another batching
    assert run(model, sampling, 1, prompts=PROMPTS[:2]) == whole[:2]  # fewer prompts
    assert run(model, Sampling(8, temperature=1.0, top_p=0.9, seed=4), 2) != whole


def test_a_stop_check_ends_its_row_only(model):
    full = run(model, Sampling(8), 2)
    stopped = run(model, Sampling(8), 2, stop=lambda index, tokens: index == 0 and len(tokens) == 3)
    assert stopped[0] == full[0][:3] and stopped[1:] == full[1:]


def test_a_prompt_is_cut_to_leave_room():
    assert fit_prompt(list(range(10)), 4, 8) == [6, 7, 8, 9]
    assert fit_prompt(list(range(10)), 4, None) == list(range(10))
