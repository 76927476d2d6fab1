"""The rules of torchao's low precision: float8 training (``precision.float8_recipe``) and an NF4
frozen base (``finetune.quantize_base=nf4``, QLoRA). What is not verified with either is
refused in one line saying what it would need; both need the ``torchao`` extra."""

from __future__ import annotations

from importlib.util import find_spec

from fsdp_lab.config.errors import ConfigError
from fsdp_lab.config.model import QuantizeBase, WeightLoading
from fsdp_lab.config.schema import Config
from fsdp_lab.config.sharding import offloaded

NF4_BLOCK = 64  # values per absmax scale
NF4_SCALER_BLOCK = 256  # scales per int8 quantisation block of the scales
NF4_SCALE_SPAN = NF4_BLOCK * NF4_SCALER_BLOCK  # values under one int8 block of scales
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / NF4_SCALE_SPAN
"""4 bits of data, an int8 scale per 64 values, an fp32 factor per 16384: ~4.13 bits."""
NF4_BITS = 8 * NF4_BYTES_PER_PARAM  # what the plan and the run's log say an NF4 weight costs
NF4_TENSOR_BYTES = 4 + 16 * 4  # and each tensor's fp32 mean and 16-value lookup table


def nf4_bytes(numel: int) -> int:
    """Bytes an NF4 tensor (or shard) of ``numel`` values occupies: data, scales, factors."""
    return numel // 2 + numel // NF4_BLOCK + 4 * (numel // NF4_SCALE_SPAN) + NF4_TENSOR_BYTES


def nf4_splits(rows: int, cols: int, shard_ways: int) -> bool:
    """Whether FSDP2 can split an NF4 weight's rows over ``shard_ways`` ranks into whole scale
    blocks each (``NF4Tensor``'s split needs it); else every rank holds it whole, in 4 bits."""
    return (
        shard_ways > 1
        and rows % shard_ways == 0
        and (rows // shard_ways * cols) % NF4_SCALE_SPAN == 0
    )


TORCHAO_EXTRA = "pip install 'fsdp_lab[torchao]' (torchao>=0.18)"


def setting(cfg: Config) -> str | None:
    """The low-precision setting a run asks for, as the user wrote it; None: neither."""
    if cfg.finetune.quantize_base is QuantizeBase.nf4:
        return "finetune.quantize_base=nf4"
    if cfg.precision.float8_recipe is not None:
        return f"precision.float8_recipe={cfg.precision.float8_recipe.name}"
    return None


def check_low_precision(cfg: Config) -> None:
    name = setting(cfg)
    if name is None:
        return
    float8 = cfg.precision.float8_recipe is not None
    nf4 = cfg.finetune.quantize_base is QuantizeBase.nf4
    refused = (
        (float8 and nf4, "float8 training: an NF4 base computes in bf16 (set one of the two)"),
        (
            cfg.parallel.tensor > 1,
            f"parallel.tensor={cfg.parallel.tensor}: its DTensor layers would need torchao's "
            "float8/NF4 tensor-parallel styles; set parallel.tensor=1",
        ),
        (
            cfg.parallel.expert > 1,
            f"parallel.expert={cfg.parallel.expert}: the experts are 3-D tensors, not linear "
            "layers; set parallel.expert=1",
        ),
        (
            offloaded(cfg.offload),
            "offload=cpu: the host copy would need torchao's subclasses on the host optimizer "
            "path; set offload=none",
        ),
    )
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{name} is not verified with {what}")
    if nf4 and cfg.model.loading is WeightLoading.rank0:
        raise ConfigError(
            "finetune.quantize_base=nf4: each rank quantises its own shards as it reads them, "
            "which model.loading=rank0's broadcast of whole weights cannot; set "
            "model.loading=per_rank"
        )
    if find_spec("torchao") is None:
        raise ConfigError(f"{name} needs torchao, which is not installed: {TORCHAO_EXTRA}")
