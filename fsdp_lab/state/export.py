"""Write a Hugging Face model directory (config.json, safetensors) from trained weights.

Streamed: the weights go out one group at a time (a tensor; one MoE layer's fused experts),
converted back to the checkpoint's own key format as ``save_pretrained`` writes it
(``engine.conversion.plan_saving``: a Mixtral's experts one tensor per expert again), straight
into safetensors files whose headers were laid out first from the shapes. No process holds more
than its shards and one group: at the end of a run (``checkpoint.export_hf=true``) every rank
takes part in gathering each tensor and rank 0 writes it; ``fsdp-lab export`` reads each group
from the checkpoint in one plain process. A LoRA run exports PEFT's adapter directory (the
adapters alone), or with ``merge`` the whole model, each adapted layer merged by PEFT's own
``merge`` as it passes.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_lab.config import (
    Config,
    ConfigError,
)
from fsdp_lab.config.model import method_row, task_row
from fsdp_lab.engine import conversion, finetune
from fsdp_lab.engine.model import (
    align_special_tokens,
    build_meta_model,
)
from fsdp_lab.internals import torch_private

# A collective where the weights are sharded: every rank calls it with the same keys, in the same
# order; the writer gets the full tensors on the host, every other rank None.
Fetch = Callable[[list[str]], "dict[str, torch.Tensor] | None"]

PEFT_PREFIX = "base_model.model."  # a PeftModel's names: PEFT_PREFIX + the run model's

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def parse_size(size: str | int) -> int:
    """``max_shard_size`` as transformers writes it ("2GB", "500MB", "200KB") in bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


class StreamedSafetensors:
    """Safetensors files written tensor by tensor, in an order known up front: each file's
    header (every tensor's dtype, shape and byte range) is written when its first tensor
    arrives, then each tensor's bytes as it comes. Files of at most ``max_bytes`` (a tensor
    larger than that gets a file of its own), named as ``save_pretrained`` names them, with
    its index where there are several."""

    def __init__(
        self, directory: Path, layout: list[tuple[str, torch.dtype, tuple]], max_bytes: int
    ):
        self.directory = directory
        files: list[list[tuple[str, torch.dtype, tuple, int]]] = [[]]
        size = 0
        for key, dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if files[-1] and size + nbytes > max_bytes:
                files.append([])
                size = 0
            files[-1].append((key, dtype, shape, nbytes))
            size += nbytes
        n = len(files)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.files = list(zip(names, files, strict=True))
        self.where = {e[0]: i for i, (_, entries) in enumerate(self.files) for e in entries}
        self.expected = [e[0] for _, entries in self.files for e in entries]
        self.total = sum(e[3] for _, entries in self.files for e in entries)
        self._next = 0
        self._open: tuple[int, object] | None = None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if key != self.expected[self._next]:
            raise RuntimeError(f"export: {key} arrived where {self.expected[self._next]} was due")
        index = self.where[key]
        if self._open is None or self._open[0] != index:
            self._close()
            self._open = (index, self._start(index))
        f = self._open[1]
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        f.write(data.view(torch.uint8).numpy() if data.numel() else b"")
        self._next += 1

    def write_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            self.write(key, tensor)

    def finish(self) -> None:
        self._close()
        if self._next != len(self.expected):
            raise RuntimeError(f"export: {len(self.expected) - self._next} tensors never arrived")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {key: self.files[i][0] for key, i in self.where.items()},
            }
            (self.directory / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )

    def _start(self, index: int):
        name, entries = self.files[index]
        header: dict = {"__metadata__": {"format": "pt"}}
        at = 0
        for key, dtype, shape, nbytes in entries:
            header[key] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [at, at + nbytes],
            }
            at += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
        f = (self.directory / name).open("wb")
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        return f

    def _close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


@dataclass(frozen=True)
class ExportTarget:
    """Where and how an export writes: ``out_dir`` new or empty, or with ``replace`` a run's own
    earlier export (swapped out once the new one is whole); LoRA adapters merged into the base
    or PEFT's adapter directory; files of at most ``max_shard_size``; the run's tokenizer."""

    out_dir: Path
    merge: bool = False
    max_shard_size: str | int = "2GB"
    replace: bool = False
    tokenizer: object = None


def export_model(
    names: dict,
    fetch: Fetch,
    target: ExportTarget,
    cfg: Config,
    hf_config,
    *,
    writer: bool,
) -> Path:
    """Export the weights of a run's model, sharded or whole, read through ``fetch``; ``names``
    are its tensors by their plain names (``conversion.owned_tensors``, or an engine's
    ``owned_tensors()``). A LoRA run's adapters as PEFT's adapter directory, unless
    ``target.merge``; every other run's, or a merged one, as a whole model.
    Complete or invisible. Every process calls it (``fetch`` may be a collective); only the
    ``writer`` writes."""
    out_dir = Path(target.out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")  # the writer's, swapped in once whole
    if writer:
        _new_out_dir(out_dir, target.replace)
        shutil.rmtree(tmp, ignore_errors=True)
    if cfg.model.arch is not None and target.tokenizer is not None:
        align_special_tokens(hf_config, target.tokenizer)
    lora = method_row(cfg.finetune.method).adapters
    if lora and not target.merge:  # PEFT's adapter directory
        values = fetch(sorted(n for n in names if conversion.is_adapter(n)))
        if writer:
            with warnings.catch_warnings():  # transformers' deprecation of a name PEFT reads
                warnings.simplefilter("ignore", FutureWarning)
                _peft_model(values, hf_config, cfg).save_pretrained(tmp, safe_serialization=True)
    else:
        read = _merging(fetch, names, cfg, hf_config) if lora else fetch
        plain = build_meta_model(hf_config, cfg.model.task)
        max_bytes = parse_size(target.max_shard_size)
        _stream_weights(plain, names, read, tmp if writer else None, max_bytes)
        if writer:
            config = plain.config
            config.use_cache = True  # trained without a KV cache; generation wants one
            config.architectures = [type(plain).__name__]
            config.save_pretrained(tmp)
            if plain.can_generate():
                from transformers import GenerationConfig

                GenerationConfig.from_model_config(config).save_pretrained(tmp)
    if writer:
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(tmp)
        _swap_into_place(tmp, out_dir)
    return out_dir


def _stream_weights(plain, names: dict, read: Fetch, tmp: Path | None, max_bytes: int) -> None:
    """Every base tensor, one group at a time, through ``read`` into safetensors files under
    ``tmp`` (the writer's; None on the other ranks, which only take part in the reads)."""
    base_keys = {conversion.checkpoint_key(n): n for n in names if not conversion.is_adapter(n)}
    groups = conversion.plan_saving(plain, list(base_keys))
    files = None
    if tmp is not None:
        tmp.mkdir(parents=True)
        layout = _layout(groups, {k: names[n][2] for k, n in base_keys.items()})
        files = StreamedSafetensors(tmp, layout, max_bytes)
    failure: OSError | None = None
    for model_keys, save in groups:
        values = read([base_keys[k] for k in model_keys])  # every rank takes part in each read
        if files is not None and failure is None:
            try:  # (the written tensors die with the call: none outlives its group)
                files.write_all(save({k: values[base_keys[k]] for k in model_keys}))
            except OSError as e:  # a full disk: the other ranks finish their part first
                failure = e
        del values  # before the next group's read: one group at a time
    if files is None:
        return
    if failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"export: writing {tmp.name[:-4]} failed ({failure}); nothing was replaced"
        )
    files.finish()


def _layout(groups, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple]]:
    """Every file tensor's key, dtype and shape, in the order the groups write them: each
    group's conversion run on meta tensors of the model's shapes."""
    out = []
    for model_keys, save in groups:
        metas = {
            k: torch.empty(tensors[k].shape, dtype=tensors[k].dtype, device="meta")
            for k in model_keys
        }
        out.extend((key, t.dtype, tuple(t.shape)) for key, t in save(metas).items())
    return out


def _merging(fetch: Fetch, names: dict, cfg: Config, hf_config) -> Fetch:
    """``fetch`` of a LoRA run's model that gives each adapted layer's weight with its adapters
    merged in, under the base layer's name: PEFT's own ``merge``, on that one layer of a PEFT
    model built on meta and lent the layer's tensors."""
    from peft.tuners.lora import LoraLayer

    peft_model = _peft_model({}, hf_config, cfg)
    layers = {
        n.removeprefix(PEFT_PREFIX): m
        for n, m in peft_model.named_modules()
        if isinstance(m, LoraLayer) and n.startswith(PEFT_PREFIX)
    }
    parts = {}  # base weight's name -> (its layer, the names of the layer's adapter tensors)
    for name, layer in layers.items():
        base = f"{name}{conversion.LORA_BASE}.weight"
        if base in names:
            parts[base] = (layer, sorted(n for n in names if n.startswith(name + ".lora_")))

    def read(keys: list[str]) -> dict[str, torch.Tensor] | None:
        extra = [n for k in keys if k in parts for n in parts[k][1]]
        values = fetch(list(keys) + extra)
        if values is None:
            return None
        for k in keys:
            if k in parts:
                layer, adapter_names = parts[k]
                values[k] = _merge_layer(layer, values[k], {n: values[n] for n in adapter_names})
        return values

    return read


def _merge_layer(layer, weight: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
    """PEFT's merge of one LoRA layer, its tensors lent for the call (then meta again)."""
    lent = [(layer.base_layer, "weight", weight)]
    for name, value in adapters.items():
        module_path, attr = name.rsplit(".", 1)
        part = module_path.split(".lora_", 1)[1]  # "A.default"
        kind, adapter = part.split(".", 1)
        lent.append((getattr(layer, f"lora_{kind}")[adapter], attr, value))
    copies = [
        (module, attr, torch.nn.Parameter(value.clone(), requires_grad=False))
        for module, attr, value in lent
    ]
    try:
        with torch_private.lent(copies), torch.no_grad():
            layer.merge(adapter_names=[finetune.ADAPTER])
            return layer.base_layer.weight.detach()
    finally:
        layer.merged_adapters.clear()


def _peft_model(adapters: dict[str, torch.Tensor], hf_config, cfg: Config):
    """A PeftModel on meta holding ``adapters`` (our names: PEFT's without
    ``base_model.model.``), given the tensors, not copies; every adapter is required unless
    none is given (the structure alone)."""
    from peft import get_peft_model

    base = build_meta_model(hf_config, cfg.model.task)
    if cfg.model.pretrained:
        base.name_or_path = cfg.model.name_or_path  # the adapter config's base model
    lora = finetune.lora_config(cfg.finetune, hf_config.model_type)
    task_type = task_row(cfg.model.task).peft_task_type
    if task_type is not None:  # so its Auto class's from_pretrained takes the dir
        lora.task_type = task_type
    peft_model = get_peft_model(base, lora, adapter_name=finetune.ADAPTER)
    if adapters:
        sd = {PEFT_PREFIX + k: v for k, v in adapters.items()}
        missing, unexpected = peft_model.load_state_dict(sd, strict=False, assign=True)
        missing = [k for k in missing if conversion.is_adapter(k)]
        if missing or unexpected:
            raise ConfigError(
                f"export: the adapters do not fit {type(base).__name__} with LoRA "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
    return peft_model


def _new_out_dir(out_dir: Path, replace: bool) -> None:
    """An export's directory: new or empty, or (``replace``) a run's own earlier export."""
    if out_dir.exists() and any(out_dir.iterdir()) and not replace:
        raise ConfigError(f"export: {out_dir} is not empty; choose a new output directory")


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
