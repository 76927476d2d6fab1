"""torchao's NF4 tensors as a run holds them: each rank's shard quantised from its own part of
the weight, its bytes, its values back (a gather for an export, a whole weight for a merge).

An ``NF4Tensor`` holds blocks of 64 values as 4-bit indices into the 16 NormalFloat levels,
each block's absmax as an int8 scale (double quantisation: the absmaxes minus their mean, in
blocks of 256 with an fp32 factor each), the mean and the 16 levels. The mean is the only
statistic of the whole tensor: ``store_nf4`` all-reduces it, so every rank's bytes are those
of torchao's ``to_nf4`` on the whole tensor, at any world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab.config.low_precision import NF4_BLOCK, NF4_SCALER_BLOCK
from fsdp_lab.engine.hardware import memory


def nf4_api():
    """(NF4Tensor, to_nf4): torchao 0.18 moved them under ``quantization``."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    except ImportError:  # torchao < 0.18
        from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
    return NF4Tensor, to_nf4


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard object itself (``to_local()`` gives a view, a new NF4 wrapper)."""
    return getattr(t, "_local_tensor", t)


def is_nf4(t: torch.Tensor) -> bool:
    return type(_local(t)).__name__ == "NF4Tensor"


def local_bytes(t: torch.Tensor) -> int:
    """What this rank's part of ``t`` occupies: an NF4 shard's data, scales and factors."""
    local = _local(t)
    if is_nf4(t):
        inner, _ = local.__tensor_flatten__()
        return sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in inner)
    return local.numel() * local.element_size()


def _absmax(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, NF4_BLOCK).abs().amax(dim=1)


def _absmax_mean(absmax: torch.Tensor, *, mesh=None) -> torch.Tensor:
    """The mean of the whole tensor's block absmaxes (of the parts held on ``mesh``, the
    DTensor's, where given: its ranks alone, so a pipeline's other stages, holding other
    tensors, take no part), summed in float64 so that the order of the sum (the world size)
    does not move its last bit. Replicas add the same shares to both sums."""
    count = torch.tensor(absmax.numel(), dtype=torch.float64)
    stats = torch.stack([absmax.double().sum(), count])
    for dim in range(mesh.ndim if mesh is not None else 0):
        dist.all_reduce(stats, group=mesh.get_group(dim))
    return (stats[0] / stats[1]).to(absmax.dtype)


def _scales(absmax: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 scales, fp32 factors): the block absmaxes centred on ``mean``, quantised in
    blocks of 256 as torchao's ``double_quantize_scalers`` does with the mean given."""
    centred = (absmax - mean).view(-1, NF4_SCALER_BLOCK)
    factor = 256 / (2 * centred.abs().amax(dim=1))
    scales = (centred * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    return scales, factor.contiguous()


def nf4_quantize(x: torch.Tensor, mean: torch.Tensor, absmax: torch.Tensor | None = None):
    """(data, int8 scales, scale factors, lookup table) of ``x`` in torchao's NF4 layout, its
    block absmaxes (``absmax``, where already taken) centred on ``mean`` (the whole tensor's,
    where ``x`` is one shard): torchao's ``NF4Tensor.from_tensor`` with the mean given."""
    nf4_tensor, _ = nf4_api()
    absmax = _absmax(x) if absmax is None else absmax
    scales, factor = _scales(absmax, mean)
    lut = _nf4_table(x.dtype, x.device)
    data = nf4_tensor.convert_to_norm_float_weight(x, absmax.numel(), NF4_BLOCK, lut)
    return data, scales, factor, lut


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """A whole weight as a run holds it in NF4, dequantised: what a merged export writes.
    torchao's ``to_nf4`` with the scales of the run's mean (its data does not depend on it)."""
    _, to_nf4 = nf4_api()
    tensor = to_nf4(x.contiguous())
    absmax = _absmax(x)
    mean = _absmax_mean(absmax)
    tensor.quantized_scalers, tensor.quantization_factor = _scales(absmax, mean)
    tensor.scaler_mean = mean
    return tensor.get_original_weight()


def _nf4_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 NormalFloat values, as torchao writes them into every NF4Tensor it builds."""
    nf4_tensor, _ = nf4_api()
    return nf4_tensor.from_tensor(torch.ones(2 * NF4_BLOCK, dtype=dtype), NF4_BLOCK, 2).nf4.to(
        device
    )


def store_nf4(target: torch.Tensor, value: torch.Tensor) -> None:
    """Quantise this rank's part ``value`` of an NF4 weight into its shard. A collective over
    the weight's mesh: its ranks store the same tensors in the same order."""
    local = _local(target)
    x = value.to(local.dtype).contiguous()
    absmax = _absmax(x)
    mean = _absmax_mean(absmax, mesh=getattr(target, "device_mesh", None))
    data, scales, factor, lut = nf4_quantize(x, mean, absmax)
    with torch.no_grad():
        local.quantized_data.copy_(data)
        local.quantized_scalers.copy_(scales)
        local.quantization_factor.copy_(factor)
    # to_empty leaves these two on meta: they are attributes, not sharded storage.
    local.scaler_mean = mean.to(x.device)
    local.nf4 = lut.to(x.device)
    # The quantiser's host temporaries (a few times the shard, 1-23 MB at 1.1B) stay below
    # glibc's mmap threshold and fragment its heap: measured at 1.1B on 2 ranks, a load peak of
    # 2.73 GB per rank for 0.51 GB of shards; returning them after each tensor, 1.19 GB.
    memory.trim_host_heap()


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """An NF4 weight's values in its dtype, sharded as it is (a DTensor stays one)."""
    local = _local(t).get_original_weight()
    if not hasattr(t, "_local_tensor"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
