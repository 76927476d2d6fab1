"""``eval.prompts``: the prompts a run completes at every evaluation, read and checked at launch,
turned into token ids with the run's tokenizer on every rank.

A prompt is a string, or a conversation (a list of ``{role, content}`` messages) that the
tokenizer's chat template renders with its generation prompt, as ``data=chat`` renders its
rows (``data.chat_template`` applies to both). A ``.json`` / ``.jsonl`` file is one JSON list
of prompts, or one prompt a line; a prompt there is a JSON string, ``{"prompt": ...}``,
``{"messages": [...]}`` or a list of messages. Other files hold one prompt a line of text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.config import ConfigError, first_line
from fsdp_lab.data import chat, formats

Prompt = str | list  # a string, or a list of messages


@dataclass(frozen=True)
class EncodedPrompt:
    index: int  # its place in eval.prompts: its sampling seed and its order in samples.jsonl
    text: str  # what the model is given, as text (a conversation: rendered by the template)
    ids: list[int]


def read_prompts(setting) -> list[Prompt]:
    """eval.prompts as a list; ConfigError in one line for a file that cannot be read, a line
    that is not a prompt, or no prompt at all."""
    if setting is None:
        return []
    if isinstance(setting, str):
        prompts = _read_file(Path(setting).expanduser())
    elif isinstance(setting, list | tuple):
        prompts = [_checked(p, lambda i=i: f"eval.prompts[{i}]") for i, p in enumerate(setting)]
    else:
        raise ConfigError(
            f"eval.prompts={setting!r}: give a list of prompts or a .jsonl / .txt file of them"
        )
    if not prompts:
        raise ConfigError(f"eval.prompts={setting!r} holds no prompt; add some or remove it")
    return prompts


def _read_file(path: Path) -> list[Prompt]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"eval.prompts={path}: cannot read it ({first_line(e)}); give a .jsonl or text file "
            "of prompts, one a line, or a list"
        ) from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix not in formats.input_format("json").suffixes:  # one prompt a line of text
        return [line for _, line in lines]
    whole = _json_list(text)
    if whole is not None:
        return [_checked(_prompt_of(v), lambda i=i: f"eval.prompts={path}: item {i}")
                for i, v in enumerate(whole)]  # fmt: skip
    prompts = []
    for n, line in lines:
        try:
            value = json.loads(line)
        except ValueError as e:
            raise ConfigError(
                f"eval.prompts={path}: line {n} is not JSON ({first_line(e)}); each line of a "
                '.jsonl file is a string, {"prompt": ...} or {"messages": [...]}'
            ) from None
        prompts.append(_checked(_prompt_of(value), lambda n=n: f"eval.prompts={path}: line {n}"))
    return prompts


def _json_list(text: str) -> list | None:
    """The prompts of a file that is one JSON list (a list of messages alone: one
    conversation), or None where it is not (one prompt a line)."""
    if not text.lstrip().startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if value and all(isinstance(m, dict) and "role" in m for m in value):
        return [value]
    return value


def _prompt_of(value):
    """A prompt as a JSON file holds it: a string, a list of messages, or under "messages"
    or "prompt"."""
    if isinstance(value, dict):
        return value.get("messages", value.get("prompt"))
    return value


def _checked(value, where) -> Prompt:
    """A string, or a list of {role, content} messages."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list | tuple) and value:
        messages = [dict(m) if hasattr(m, "items") else m for m in value]
        if all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            return messages
    raise ConfigError(
        f'{where()} is not a prompt: give a non-empty string, {{"prompt": "..."}} or '
        '{"messages": [{"role": "user", "content": "..."}]}'
    )


def _without_eos(ids: list[int], tokenizer) -> list[int]:
    """A prompt's ids without the EOS some tokenizers append (T5's, ByT5's): the model is to
    continue the text, not to start after its end."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return list(ids[:-1]) if len(ids) > 1 and eos is not None and ids[-1] == eos else list(ids)


def encode_prompts(prompts: list[Prompt], tokenizer, chat_template: str | None) -> list:
    """Each prompt's text and token ids. A string takes the tokenizer's special tokens (its BOS)
    as ``tokenizer(text)`` adds them; a conversation is rendered by the chat template
    (``data.chat_template``, else the tokenizer's), whose text carries its own."""
    template = None
    if any(not isinstance(p, str) for p in prompts):
        try:
            template = chat.template_of(tokenizer, chat_template)
        except ConfigError as e:
            why = str(e).removeprefix("data.chat_template: ")
            raise ConfigError(f"eval.prompts holds chat messages, but {why}") from None
    fmt = chat.ChatFormat(
        layout="messages", template=template, template_vars=chat.template_vars_of(tokenizer)
    )
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, ids = prompt, _without_eos(tokenizer(prompt)["input_ids"], tokenizer)
        else:
            text = chat.render_prompt(prompt, fmt, lambda index=index: f"eval.prompts[{index}]")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        encoded.append(EncodedPrompt(index=index, text=text, ids=list(ids)))
    return encoded
