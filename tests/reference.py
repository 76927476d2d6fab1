"""An unsharded single-process run of the same model, data and optimizer as a sharded run.

Built from the same pieces (seeded init, the global batch of each step, AdamW, the schedule),
with no FSDP: what every strategy must reproduce in fp32.
"""

from __future__ import annotations

import math

import torch

from fsdp_lab.config import Config
from fsdp_lab.data import SyntheticData
from fsdp_lab.model import build_full_model, build_hf_config
from fsdp_lab.optim import build_optimizer, build_scheduler


def reference_run(cfg: Config, *, world_size: int) -> tuple[list[float], list[float]]:
    """(loss, gradient norm before clipping) of every step."""
    torch.set_num_threads(1)
    t = cfg.trainer
    hf_config = build_hf_config(cfg.model)
    model = build_full_model(hf_config, seed=cfg.seed)
    model.train()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=t.max_steps)
    data = SyntheticData(seed=cfg.seed, vocab_size=hf_config.vocab_size, seq_len=t.seq_len,
                         micro_batch_size=t.micro_batch_size,
                         grad_accum_steps=t.grad_accum_steps, dp_size=world_size, dp_rank=0,
                         masking=None)
    losses, norms = [], []
    for step in range(t.max_steps):
        total = 0.0
        for micro in range(t.grad_accum_steps):
            ids = data.global_batch(step, micro)
            loss = model(input_ids=ids, labels=ids).loss / t.grad_accum_steps
            loss.backward()
            total += loss.item()
        clip = cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              clip if clip is not None else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(total)
        norms.append(norm.item())
    return losses, norms
