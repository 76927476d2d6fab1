"""Every private name of transformers that fsdp_lab uses, each with the public API it waits
for. As ``torch_private``: looked up when used, an upgrade that moves one fails there with a
line naming it; ``check()`` looks all of them up at once (the tests run it). Importing this
module imports no transformers: each function takes objects of it, or imports it when used."""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Private:
    """``module``'s ``name``, and what would replace it."""

    module: str
    name: str
    waits_for: str

    def get(self) -> Any:
        try:
            return getattr(importlib.import_module(self.module), self.name)
        except (ImportError, AttributeError) as e:
            from transformers import __version__

            raise RuntimeError(
                f"transformers {__version__} has no {self.module}.{self.name}, "
                f"which fsdp_lab uses until {self.waits_for} ({e}): pin the transformers of "
                "pyproject.toml's range"
            ) from None


NAMES = {
    "compile_jinja": Private(
        "transformers.utils.chat_template_utils",
        "_compile_jinja_template",
        "a public compile (or syntax check) of a chat template with transformers' extensions",
    ),
}
# A model's own per-module init and its lists of keys a checkpoint may hold beyond its tensors,
# or a save leaves out: read, never set. Waits for public ones (init_weights() inits the whole
# model; the key lists have no public reader).
MODEL_ATTRIBUTES = (
    "_init_weights",
    "_keys_to_ignore_on_load_unexpected",
    "_keys_to_ignore_on_save",
)
# A config's attention and experts implementations: attributes every model's code reads, set
# through their properties (which recurse into sub-configs). Public on models
# (set_attn_implementation, set_experts_implementation), private on configs.
CONFIG_ATTRIBUTES = ("_attn_implementation", "_experts_implementation")


def check() -> list[str]:
    """Each name this transformers lacks, as a line (empty: every one is where it is looked
    for)."""
    import transformers

    missing = []
    for private in NAMES.values():
        try:
            private.get()
        except RuntimeError as e:
            missing.append(str(e))
    missing += [
        f"transformers {transformers.__version__}: PreTrainedModel has no {attr}, which "
        "fsdp_lab reads"
        for attr in MODEL_ATTRIBUTES
        if not hasattr(transformers.PreTrainedModel, attr)
    ]
    config = transformers.PretrainedConfig()
    for attr in CONFIG_ATTRIBUTES:
        if not isinstance(getattr(type(config), attr, None), property):
            missing.append(
                f"transformers {transformers.__version__}: PretrainedConfig.{attr} is no longer "
                "a property: fsdp_lab reads and sets a config's implementations through it"
            )
    return missing


def compile_chat_template(text: str):
    """A chat template compiled as transformers renders it (its extensions: the
    ``{% generation %}`` tag); jinja2's TemplateSyntaxError where it is not valid."""
    return NAMES["compile_jinja"].get()(text)


def attn_implementation(config) -> str | None:
    """The attention implementation ``config`` names (None where it is not a transformers
    config)."""
    value = getattr(config, "_attn_implementation", None)
    return value if isinstance(value, str) else None


def set_attn_implementation(config, name: str) -> None:
    """``config`` (and its sub-configs) attend through ``name``; a model built from it does.
    On a built model use its public ``set_attn_implementation``."""
    config._attn_implementation = name


def with_attn_implementation(config, name: str):
    """A shallow copy of ``config`` that names ``name`` (the model's own config untouched)."""
    other = copy.copy(config)
    other._attn_implementation_internal = name  # the copy only: no sub-config is shared
    return other


def with_experts_implementation(config, name: str):
    """A shallow copy of ``config`` whose experts run ``name`` (the original untouched)."""
    other = copy.copy(config)
    other._experts_implementation_internal = name  # the copy only: no sub-config is shared
    return other


def experts_implementation(config) -> str | None:
    """The experts' kernel ``config`` names (None where none is set)."""
    value = getattr(config, "_experts_implementation", None)
    return value if isinstance(value, str) else None


def set_experts_implementation(config, name: str) -> None:
    """``config``'s experts (and its sub-configs') run ``name``'s kernel; read by the experts'
    forward on every call. Public for building: ``from_config(..., experts_implementation=)``."""
    config._experts_implementation = name


def init_weights(model):
    """``model``'s own init of one of its modules (``_init_weights(module)``: what
    ``from_config`` draws), or None where ``model`` is not a transformers model."""
    return getattr(model, "_init_weights", None)


def keys_to_ignore(model, when: str) -> list[str]:
    """``model``'s patterns of keys to ignore ``when`` is ``on_load_unexpected`` (a checkpoint's
    extra keys) or ``on_save`` (keys a save leaves out)."""
    return list(getattr(model, f"_keys_to_ignore_{when}", None) or [])
