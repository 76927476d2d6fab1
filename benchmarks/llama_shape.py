"""The model shape every side of a benchmark reads from the same flags: the Llama of the run.

The peer scripts (hf_trainer_side.py, ceiling_fsdp.py, minimal_fsdp.py) run as their own
processes (torchrun), so this sits beside them and is imported by file name.
"""

from __future__ import annotations

import argparse

from transformers import LlamaConfig

SHAPE = ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "steps")


def shape_parser(*extra_required: str) -> argparse.ArgumentParser:
    """A parser with the shape's integer flags, and ``extra_required`` ones, all required."""
    p = argparse.ArgumentParser()
    for name in (*SHAPE, *extra_required):
        p.add_argument(f"--{name}", type=int, required=True)
    return p


def llama_config(a: argparse.Namespace, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.seq,
        bos_token_id=0,
        eos_token_id=1,
        **extra,
    )
