"""The baseline: a minimal hand-written FSDP2 loop, run under torchrun by bench_overhead.py.

Same model, batch, strategy (fully_shard per decoder layer + root) and optimizer as fsdp_lab's
run, with none of fsdp_lab: no config, no metrics, no logging. Prints one JSON line on rank 0.
"""

import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from llama_shape import llama_config, shape_parser
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

p = shape_parser("threads")
p.add_argument("--reshard", type=int, default=1)
a = p.parse_args()

torch.set_num_threads(a.threads)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
cfg = llama_config(a)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(cfg)
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh, reshard_after_forward=bool(a.reshard))
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")
full = AutoModelForCausalLM.from_config(cfg).state_dict() if rank == 0 else {}
set_model_state_dict(
    model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
)
with torch.no_grad():  # the rotary buffer is garbage after to_empty
    rope = model.model.rotary_emb
    rope.inv_freq.copy_(type(rope).compute_default_rope_parameters(rope.config)[0])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(rank)
start = None
for step in range(a.steps):
    if step == 1:
        start = time.perf_counter()
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_value = loss.item()
elapsed = time.perf_counter() - start
if rank == 0:
    print(json.dumps({"s_per_step": elapsed / (a.steps - 1), "loss": loss_value}), flush=True)
dist.destroy_process_group()
os._exit(0)
