"""The models the plan tests size (unit: fake group; integration: real runs), and the plan's
peak as those tests measure it."""

from __future__ import annotations

from fsdp_lab.tools import memory

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


def peak_less_params(s: dict, rank: int) -> int:
    """The plan's peak for ``rank`` less what was there before the first step (its params)."""
    mine = memory.StateBytes(**s["per_rank"][rank])
    return (
        memory.peak(
            mine,
            activations=s["activations"],
            transient_bytes=s["transient"]["total"],
            end_of_backward=s["transient"]["end_of_backward"],
        )
        - mine.params
        - (mine.padding - mine.grad_padding)
    )
