"""The ceiling side of bench_gpu.py: a minimal hand-written fully_shard + torch.compile loop.

torchtitan's recipe on a Hugging Face Llama and nothing else: each decoder layer compiled, then
``fully_shard`` per layer and at the root with a bf16 MixedPrecisionPolicy (fp32 reduction),
fused AdamW, clipping, the model's own loss, random tokens made on the device, and no host sync
between the timed boundaries. Run under ``torchrun``; prints one JSON line on rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from llama_shape import llama_config, shape_parser
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM


def main() -> None:
    p = shape_parser("warmup")
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=1, help="0: no fully_shard, autocast bf16")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600), device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = llama_config(a, use_cache=False)
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(cfg) if rank == 0 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    if a.compile:
        for layer in model.model.layers:
            layer.compile()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=not a.fsdp)
    if a.fsdp:
        mesh = init_device_mesh("cuda", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, layer in enumerate(model.model.layers):
            fully_shard(
                layer,
                mesh=mesh,
                mp_policy=mp,
                reshard_after_forward=i < len(model.model.layers) - 1,
            )
        fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    set_model_state_dict(
        model,
        full.state_dict() if full is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    with torch.no_grad():  # the rotary buffer is garbage after to_empty
        rope = model.model.rotary_emb
        rope.inv_freq.copy_(type(rope).compute_default_rope_parameters(rope.config)[0])
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    gen = torch.Generator(device=device).manual_seed(rank)
    start = None
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen, device=device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1:
            torch.cuda.reset_peak_memory_stats()  # as the others: the steps' peak, state included
        if step == a.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
    torch.cuda.synchronize()
    s_per_step = (time.perf_counter() - start) / (a.steps - a.warmup)
    if rank == 0:
        print(
            json.dumps(
                {
                    "s_per_step": s_per_step,
                    "tokens_per_s": world * a.batch * a.seq / s_per_step,
                    "peak_mem_bytes": torch.cuda.max_memory_allocated(),
                    "loss": loss.item(),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
