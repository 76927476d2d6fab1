"""A training step of calibrate's own tiny model through fsdp_lab's step (``train.loop
.train_step``: the loss, FSDP2 per layer, clipping over the sharded gradients, AdamW), timed on
every rank, and predicted from the rest of the profile: what it costs beyond its predicted
work is the step's host cost that nothing else prices (``DeviceProfile.step_host_s``: the
loss's scale, the micro-batch's bookkeeping, Python between the pieces). Worth a few ms: most
of a tiny model's step, nothing of a large one's.
"""

from __future__ import annotations

from fsdp_lab.config import HardwareKind

# A two-layer Llama of hidden 32 over 2 x 32 tokens: not a model a run trains (the default
# is hidden 64 over 4 x 64), small enough that its step is the loop's own costs.
MODEL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "trainer.seq_len=32",
    "model.max_position_embeddings=32",
    "trainer.micro_batch_size=2",
    "checkpoint=none",
    "logger=none",
]


def overrides(kind: HardwareKind, nproc: int, dtype: str) -> list[str]:
    """The tiny model's run on these ranks, as ``fsdp-lab plan`` composes it."""
    precision = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}.get(dtype, "fp32")
    return [f"hardware={kind.name}", f"hardware.nproc_per_node={nproc}",
            f"precision={precision}", *MODEL]  # fmt: skip


def step(cfg, topo, device, budget):
    """``train_step``'s time on this rank for the tiny model (a collective: every rank)."""
    import torch
    import torch.distributed as dist

    from fsdp_lab.engine import fsdp
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.engine.hardware import devices
    from fsdp_lab.engine.hardware.timing import median_interval, time_together
    from fsdp_lab.planning.plan_model import trace_hf_config
    from fsdp_lab.train import loss as loss_lib
    from fsdp_lab.train.loop import train_step
    from fsdp_lab.train.optim import build_optimizer, resolve_implementation

    hf = trace_hf_config(cfg)
    kind = loss_lib.resolve_loss(cfg.loss, hf, cfg.model.task, topo.device, compiled=False)
    meta, loss = loss_lib.meta_model_with_loss(
        cfg, hf, kind, compiled=False, compute_dtype=devices.TORCH_DTYPES[cfg.precision.param_dtype]
    )
    sharded = fsdp.build_model(
        cfg, topo, device, meta_model=meta, source=lambda: model_lib.full_model(hf, seed=0)
    )
    impl = resolve_implementation(cfg.optim, topo.device, grad_scaler=False)
    optimizer = build_optimizer(sharded.model, cfg.optim, implementation=impl)
    t = cfg.trainer
    ids = torch.randint(0, hf.vocab_size, (t.micro_batch_size, t.seq_len), device=device)
    batch = {"input_ids": ids, "labels": ids}
    world = dist.get_world_size()
    targets = world * t.micro_batch_size * (t.seq_len - 1)

    def one() -> None:
        train_step(sharded.model, [batch], targets=targets, dp=world, optimizer=optimizer,
                   scaler=None, grad_clip=cfg.optim.grad_clip, loss=loss)  # fmt: skip

    # the median step, as a run's check compares its median step with the prediction
    return time_together(one, device, budget, statistic=median_interval)
