"""What a position learns: labels and the targets a causal LM predicts from them."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # labels the loss skips (transformers' convention)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1; the last position predicts nothing (as HF pads it)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
