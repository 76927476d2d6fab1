"""The baseline of bench_loading.py: every rank loads the whole pretrained model, then shards.

What a plain `from_pretrained` on each rank followed by `fully_shard` costs in host memory (the
pattern RAM-efficient loading replaces). Run under torchrun; prints one JSON line on rank 0:
each rank's peak RSS after imports and after loading + sharding.
"""

import argparse
import datetime
import json
import resource

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
base = peak_rss()
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
loaded = peak_rss()
stats = [None] * world
dist.all_gather_object(stats, {"base": base, "loaded": loaded})
if rank == 0:
    print(json.dumps(stats))
dist.destroy_process_group()
