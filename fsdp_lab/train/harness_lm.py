"""lm-evaluation-harness's model interface on fsdp_lab's models: requests run on a sharded model
on every rank in lockstep, or on one process's plain Hugging Face model (``fsdp-lab eval``).

Every rank runs lm-eval's evaluator the same way, as a world of one (the same tasks, documents
and requests, in the same order): ``ShardedLM`` splits each call's requests across the
data-parallel ranks itself, runs them (the same number of forwards everywhere) and gathers every
rank's answers, so each evaluator sees all of them and computes the same scores. Tokenisation,
truncation and the reading of answers follow lm-eval's ``HFLM``, so a score equals ``HFLM``'s on
the same weights (tests/integration/test_evaluation_runs.py).

Imports lm-eval: reached only through ``train.harness`` once lm-eval is known to be installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from fsdp_lab.config import ConfigError
from fsdp_lab.train.generate import Lockstep, Request, Sampling, fit_prompt, generate

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's, for a generation task that names no max_gen_toks


class ShardedLM(TemplateLM):
    """lm-eval's model interface over ``model``: a sharded one (every rank calls the evaluator
    the same way) or a plain one (the default ``Lockstep``: one process). ``decoding``:
    ``train.evaluation.Decoding``, the tokenizer and its special ids."""

    def __init__(self, model, decoding, *, lock: Lockstep, batch_size: int) -> None:
        super().__init__()
        self.model, self.decoding, self.lock = model, decoding, lock
        self.tokenizer = decoding.tokenizer
        self._batch_size = batch_size
        self._max_length = decoding.max_positions or 2048

    # What lm-eval's evaluator reads of a model: a world of one on every rank.
    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """As HFLM: the tokenizer's own special tokens, unless the text opens with BOS."""
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            extra = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **extra)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(log P(continuation | context), whether it is the greedy continuation) of each
        request; this rank computes its share, then every rank has every answer."""
        self._check(requests)
        indexed = list(enumerate(requests))
        mine = self.lock.share(indexed)
        mine.sort(key=lambda item: -len(item[1][1] + item[1][2]))  # similar lengths batch
        batches = [mine[i : i + self._batch_size] for i in range(0, len(mine), self._batch_size)]
        answers: list[tuple[int, tuple[float, bool]]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for b in range(self.lock.most(len(batches))):
                batch = batches[b] if b < len(batches) else []
                answers += self._score(batch)
        finally:
            self.model.train(was_training)
        return self.lock.gather(answers)

    def _check(self, requests) -> None:
        """On every rank alike (the same requests everywhere): continuations HFLM would refuse
        fail here on all ranks, not on the one that holds them; and the requests are the same
        on every rank (a rank's own answers would otherwise be gathered under others' order)."""
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self._max_length:
                raise ConfigError(
                    f"a harness request has a context of {len(context)} and a continuation of "
                    f"{len(continuation)} tokens (the model takes {self._max_length}); check "
                    "the task's doc_to_text and doc_to_choice"
                )
        self.lock.check_same([r[1:] for r in requests], "harness requests")

    @torch.no_grad()
    def _score(self, batch) -> list[tuple[int, tuple[float, bool]]]:
        """One forward over a right-padded batch (none: a placeholder row)."""
        limit = self._max_length
        rows = []
        for index, (_, context, continuation) in batch:
            whole = (context + continuation)[-(limit + 1) :][:-1]
            rows.append((index, whole, continuation))
        inputs = [whole for _, whole, _ in rows] or [[self.prefix_token_id]]
        width = max(len(x) for x in inputs)
        pad = self.decoding.pad_id
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in inputs])
        logits = self.model(input_ids=ids.to(self.lock.device)).logits
        out = []
        for (index, whole, continuation), row in zip(rows, logits, strict=False):
            # The continuation's positions only, in fp32: not a B x T x V fp32 copy.
            n = len(continuation)
            picked = F.log_softmax(row[len(whole) - n : len(whole)].float(), dim=-1).cpu()
            target = torch.tensor(continuation, dtype=torch.long)
            greedy = bool((picked.argmax(dim=-1) == target).all())
            total = float(picked.gather(1, target[:, None]).sum())
            out.append((index, (total, greedy)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Each text's whole log-likelihood, window by window of the model's length."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for window in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, *window))
                owners.append(n)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, scores, strict=True):
            totals[n] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Each context's continuation up to its stop strings, as HFLM decodes it."""
        eos = self.tokenizer.decode([self.eot_token_id])
        by_kwargs: dict[str, list[tuple[int, str, dict]]] = {}
        for n, (context, gen_kwargs) in enumerate(req.args for req in requests):
            by_kwargs.setdefault(repr(sorted(gen_kwargs.items())), []).append(
                (n, context, gen_kwargs)
            )
        self.lock.check_same([r.args for r in requests], "harness generation requests")
        results: dict[int, str] = {}
        # Every rank holds the same requests, so the groups come in the same order on all.
        for group in by_kwargs.values():
            kwargs = normalize_gen_kwargs(group[0][2], DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            results.update(self._generate_group(group, kwargs, until))
        return [results[n] for n in range(len(requests))]

    def _generate_group(self, group, kwargs: dict, until: list[str]) -> dict[int, str]:
        max_gen = int(kwargs.pop("max_gen_toks"))
        if self._max_length <= max_gen:
            raise ConfigError(
                f"a harness task asks for {max_gen} new tokens, beyond the model's "
                f"{self._max_length} positions; lower the task's max_gen_toks"
            )
        sampling = Sampling(
            max_gen,
            temperature=float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0,
            top_p=float(kwargs.get("top_p") or 1.0),
        )
        requests = [
            Request(
                n,
                fit_prompt(self.tok_encode(context), max_gen, self._max_length)
                or [self.prefix_token_id],
            )
            for n, context, _ in group
        ]
        decode = self.decoding.text

        def stop(index: int, tokens: list[int]) -> bool:
            # Raw, as HFLM's stop check decodes: a stop string may be a special token.
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
            return any(s in text for s in until)

        mine = self.lock.share(requests)
        outputs = generate(
            self.model,
            mine,
            sampling,
            lock=self.lock,
            batch_size=self._batch_size,
            eos_ids=self.decoding.eos_ids,
            pad_id=self.decoding.pad_id,
            stop=stop,
        )
        texts = [
            (
                r.index,
                postprocess_generated_text(
                    generation=decode(out), stop=until, think_end_token=None
                ),
            )
            for r, out in zip(mine, outputs, strict=True)
        ]
        return dict(zip([r.index for r in requests], self.lock.gather(texts), strict=True))
