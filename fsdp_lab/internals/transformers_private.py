"""Every private name of transformers that fsdp_lab uses, each with the public API it waits
for. As ``torch_private``: looked up when used, an upgrade that moves one fails there with a
line naming it; ``check()`` looks all of them up at once (the tests run it). Importing this
module imports no transformers: each function takes objects of it, or imports it when used."""

from __future__ import annotations

import copy
import functools

from fsdp_lab.internals import lookup

Private = functools.partial(lookup.Private, "transformers")

NAMES = {
    "compile_jinja": Private(
        "transformers.utils.chat_template_utils",
        "_compile_jinja_template",
        "a public compile (or syntax check) of a chat template with transformers' extensions",
    ),
}
# A model class's construction from a config (what the Auto classes' from_config calls; public
# only through them, which choose the class themselves), a model's own per-module init and its
# lists of keys a checkpoint may hold beyond its tensors,
# or a save leaves out: read, never set. Waits for public ones (init_weights() inits the whole
# model; the key lists have no public reader).
MODEL_ATTRIBUTES = (
    "_from_config",
    "_init_weights",
    "_keys_to_ignore_on_load_unexpected",
    "_keys_to_ignore_on_save",
)
# A config's attention and experts implementations: attributes every model's code reads, set
# through their properties (which recurse into sub-configs). Public on models
# (set_attn_implementation, set_experts_implementation), private on configs.
KINDS = ("attn", "experts")
CONFIG_ATTRIBUTES = tuple(f"_{kind}_implementation" for kind in KINDS)


def check() -> list[str]:
    """Each name this transformers lacks, as a line (empty: every one is where it is looked
    for)."""
    import transformers

    missing = lookup.missing(NAMES.values())
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


def implementation(config, kind: str) -> str | None:
    """The ``kind`` (``attn`` or ``experts``) implementation ``config`` names (None where it
    names none, or is not a transformers config)."""
    value = getattr(config, f"_{kind}_implementation", None)
    return value if isinstance(value, str) else None


def set_implementation(config, kind: str, name: str) -> None:
    """``config`` (and its sub-configs) run ``name`` as their ``kind`` implementation; so
    does a model built from it, whose modules read it on every call. On a built model use its
    public ``set_attn_implementation`` / ``set_experts_implementation``."""
    setattr(config, f"_{kind}_implementation", name)


def with_implementation(config, kind: str, name: str):
    """A shallow copy of ``config`` whose ``kind`` implementation is ``name`` (the original
    untouched: the copy's own attribute is set, never its sub-configs, which it shares)."""
    other = copy.copy(config)
    setattr(other, f"_{kind}_implementation_internal", name)
    return other


def from_config(cls, config):
    """A model of ``cls`` (a subclass of a transformers model class) built from ``config`` as
    ``AutoModelFor*.from_config`` builds the class it chooses."""
    return cls._from_config(config)


def init_weights(model):
    """``model``'s own init of one of its modules (``_init_weights(module)``: what
    ``from_config`` draws), or None where ``model`` is not a transformers model."""
    return getattr(model, "_init_weights", None)


def keys_to_ignore(model, when: str) -> list[str]:
    """``model``'s patterns of keys to ignore ``when`` is ``on_load_unexpected`` (a checkpoint's
    extra keys) or ``on_save`` (keys a save leaves out)."""
    return list(getattr(model, f"_keys_to_ignore_{when}", None) or [])
