"""The precisions, one row each: the only place that says what a dtype means to a run, and what
a float8 recipe does. Imports no torch (the engine turns ``torch_name`` into the dtype).

| dtype | bytes | torch    | peak FLOP/s | 16-bit | loss scaling | hardware=tpu | CPU probe   |
| fp32  | 4     | float32  | fp32 (tf32) | no     | no           | yes          |             |
| bf16  | 2     | bfloat16 | bf16        | yes    | no           | yes          | mkldnn bf16 |
| fp16  | 2     | float16  | bf16's      | yes    | needed       | refused      | mkldnn fp16 |

| float8_recipe | scales       | all-gathers float8 (default) |
| tensorwise    | one a tensor | yes (on)                     |
| rowwise       | one a row    | no                           |

A new dtype is a ``Dtype`` member and a row here (a new float8 recipe, e.g. MXFP8, a
``Float8Recipe`` member and a row); the rules, devices, MFU, the plan, the time model and
calibrate read the rows, and nothing else dispatches on a dtype's or recipe's name
(tests/unit/config/test_precisions.py holds this).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config.errors import ConfigError
from fsdp_lab.config.sharding import Dtype, Float8Recipe, PrecisionConfig


@dataclass(frozen=True)
class DtypeRow:
    bytes: int
    """An element's bytes: what the memory plan, the time model and calibrate count."""
    torch_name: str
    """``torch.<torch_name>``."""
    peak: str
    """The peak-FLOP/s key of a hardware profile's ``compute`` (fp16 runs at bf16's)."""
    half: bool
    """16 bits: MFU counts the device's low-precision peak; a CPU may lack native kernels."""
    needs_scaler: bool = False
    """Gradients underflow without loss scaling (precision.grad_scaler_enabled)."""
    cpu_probe: str | None = None
    """``torch.ops.mkldnn``'s check that this CPU has native matmuls in it."""
    gpu_probe: str | None = None
    """The GPU's check that it computes in it (bf16: Ampere or newer)."""


DTYPES: dict[Dtype, DtypeRow] = {
    Dtype.fp32: DtypeRow(bytes=4, torch_name="float32", peak="fp32", half=False),
    Dtype.bf16: DtypeRow(
        bytes=2,
        torch_name="bfloat16",
        peak="bf16",
        half=True,
        cpu_probe="_is_mkldnn_bf16_supported",
        gpu_probe="is_bf16_supported",
    ),
    Dtype.fp16: DtypeRow(
        bytes=2,
        torch_name="float16",
        peak="bf16",
        half=True,
        needs_scaler=True,
        cpu_probe="_is_mkldnn_fp16_supported",
    ),
}


def dtype_row(dtype: Dtype) -> DtypeRow:
    return DTYPES[dtype]


def peak_key(name: str) -> str:
    """The peak-FLOP/s key a compute dtype named ``name`` runs at (fp16: bf16's); a key that
    names no dtype (fp8, tf32) as it is."""
    return DTYPES[Dtype(name)].peak if name in Dtype._value2member_map_ else name


@dataclass(frozen=True)
class Float8Row:
    all_gather: bool
    """FSDP2 can all-gather its weights in float8 (one scale per tensor), on by default."""
    compute: Dtype = Dtype.bf16
    """What the rest of the model computes in, around the float8 matmuls."""


FLOAT8_RECIPES: dict[Float8Recipe, Float8Row] = {
    Float8Recipe.tensorwise: Float8Row(all_gather=True),
    Float8Recipe.rowwise: Float8Row(all_gather=False),
}
TUNED_RECIPE = Float8Recipe.tensorwise  # what fsdp-lab tune tries beside each bf16 candidate


def float8_all_gather(p: PrecisionConfig) -> bool:
    """Whether FSDP2 all-gathers the float8 layers' weights in float8: as set, else the
    recipe's default (off without float8)."""
    if p.float8_recipe is None:
        return False
    if p.float8_all_gather is None:
        return FLOAT8_RECIPES[p.float8_recipe].all_gather
    return p.float8_all_gather


def check_precision(p: PrecisionConfig) -> None:
    """The precision group's own rules, read off the rows."""
    if p.float8_recipe is None and p.float8_all_gather is not None:
        raise ConfigError(
            "precision.float8_all_gather applies only to float8 training; set "
            "precision=float8 (or precision.float8_recipe=tensorwise), or remove it"
        )
    recipe = FLOAT8_RECIPES.get(p.float8_recipe)
    if recipe is not None and p.float8_all_gather and not recipe.all_gather:
        gathers = [r.name for r, row in FLOAT8_RECIPES.items() if row.all_gather]
        raise ConfigError(
            f"precision.float8_all_gather=true needs precision.float8_recipe="
            f"{'/'.join(gathers)} (torchao all-gathers float8 weights with one scale per "
            "tensor only)"
        )
    if recipe is not None and p.param_dtype is not recipe.compute:
        raise ConfigError(
            f"precision.float8_recipe computes around its float8 matmuls in "
            f"{recipe.compute.name}, not {p.param_dtype.name}; set "
            f"precision.param_dtype={recipe.compute.name} (precision=float8 does)"
        )
    if dtype_row(p.param_dtype).needs_scaler and not p.grad_scaler_enabled:
        raise ConfigError(
            f"precision.param_dtype={p.param_dtype.name} needs "
            "precision.grad_scaler_enabled=true (its gradients underflow without loss "
            f"scaling); or use precision={p.param_dtype.name}"
        )
