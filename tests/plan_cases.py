"""The models the plan tests size (unit: fake group; integration: real runs); the plan's peak
as those tests measure it is ``StrategyPlan.peak_over_start``."""

from __future__ import annotations

MEDIUM = [
    "hardware=cpu",
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "model.num_layers=4",
    "trainer.seq_len=256",
    "trainer.micro_batch_size=8",
]
# The root unit (embeddings and head, 8M parameters each) outweighs the two layers and the
# activations: its gradients and their reduce-scatter at the end of backward set or rival the
# peak.
BIG_VOCAB = [
    "hardware=cpu",
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "model.num_layers=2",
    "model.vocab_size=32768",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=2",
]

# A model=local directory at issue 28's shapes (hidden 512, 6 layers, 8 heads, vocabulary 8192),
# 4 x 256 tokens per rank on 2 ranks: layouts the presets do not cover.
LOCAL = [
    "hardware=cpu",
    "hardware.nproc_per_node=2",
    "sharding=grad_op",
    "trainer.seq_len=256",
    "trainer.micro_batch_size=4",
    "model=local",
    "model.pretrained=false",
]


def _gpt2_dropout():
    """GPT-2 as transformers defaults it: every dropout 0.1 (the preset sets them to 0)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=8192, n_embd=512, n_layer=6, n_head=8, n_positions=256)


def _neox():
    """GPT-NeoX: LayerNorms, fused qkv, a quarter of each head rotated, parallel residual."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        intermediate_size=2048,
        max_position_embeddings=256,
    )


LOCAL_CONFIGS = {"gpt2-dropout": _gpt2_dropout, "neox": _neox}
