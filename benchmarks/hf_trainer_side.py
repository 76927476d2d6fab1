"""The peer side of bench_gpu.py and bench_peer.py: Hugging Face Trainer on the same model and
batch.

Run under ``torchrun`` (accelerate's FSDP needs a process group, even of one). Two setups:

* ``--mode docs``: as transformers' FSDP guide sets it up: ``fsdp=True`` with an FSDP2
  ``fsdp_config`` (transformer-based wrap of the decoder layers, reshard after forward, sharded
  state dict), ``bf16=True``, SDPA attention, the default optimizer (``adamw_torch_fused`` on
  torch >= 2.8);
* ``--mode fast``: the same plus Trainer's own speed options: ``torch_compile=True``,
  ``optim="adamw_torch_fused"`` and ``use_liger_kernel=True`` where liger-kernel is installed.

On CPU (``--cpu``) Trainer ignores FSDP and trains DDP; that is the peer of bench_peer.py.
Prints one JSON line on rank 0: seconds per step (wall time of steps warmup+1..steps, the device
synchronised at both ends), tokens/s and the device's peak memory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile
import time

import torch
from llama_shape import llama_config, shape_parser
from transformers import (
    AutoModelForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class RandomTokens(torch.utils.data.Dataset):
    """Uniform random token ids, a fixed function of the index (the content does not matter
    for speed; every side reads the same shapes)."""

    def __init__(self, vocab: int, seq: int) -> None:
        self.vocab, self.seq = vocab, seq

    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(
            0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(index)
        )
        return {"input_ids": ids, "labels": ids}


class Timer(TrainerCallback):
    """Wall time between the end of step ``warmup`` and the end of the last step, and each
    step's own (exact on CPU, where operations run as they are called)."""

    def __init__(self, warmup: int, cuda: bool) -> None:
        self.warmup, self.cuda, self.start, self.end = warmup, cuda, None, None
        self.steps: list[float] = []
        self._begin = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self._begin)
        if state.global_step == self.warmup:
            self._sync()
            self.start = time.perf_counter()
        elif state.global_step == args.max_steps:
            self._sync()
            self.end = time.perf_counter()


def main() -> None:
    p = shape_parser("warmup")
    p.add_argument("--mode", choices=["docs", "fast"], default="docs")
    p.add_argument("--cpu", action="store_true", help="CPU ranks: Trainer's DDP (bench_peer)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = llama_config(a, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    extra: dict = {}
    if not a.cpu:
        extra.update(
            bf16=True,
            fsdp=True,
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
                "state_dict_type": "SHARDED_STATE_DICT",
            },
        )
    if a.mode == "fast":
        extra.update(
            torch_compile=True,
            optim="adamw_torch_fused",
            use_liger_kernel=importlib.util.find_spec("liger_kernel") is not None,
        )
    timer = Timer(a.warmup, cuda=not a.cpu)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=a.batch,
            max_steps=a.steps,
            learning_rate=3e-4,
            warmup_steps=min(20, a.steps),
            lr_scheduler_type="cosine",
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            logging_steps=a.steps,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            use_cpu=a.cpu,
            **extra,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=RandomTokens(a.vocab, a.seq), callbacks=[timer]
        )
        trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        s_per_step = (timer.end - timer.start) / (a.steps - a.warmup)
        print(
            json.dumps(
                {
                    "s_per_step": s_per_step,
                    "tokens_per_s": world * a.batch * a.seq / s_per_step,
                    "median_step_s": statistics.median(timer.steps[a.warmup :]),
                    "peak_mem_bytes": torch.cuda.max_memory_allocated() if not a.cpu else None,
                    "wrapped": type(trainer.model_wrapped).__name__,
                    "fsdp": bool(getattr(trainer, "is_fsdp_enabled", False)),
                    "liger": bool(extra.get("use_liger_kernel")),
                    "optim": args.optim,
                    "compile": args.torch_compile,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
