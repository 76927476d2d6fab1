"""One chat or instruction row as ordered text pieces, each trained (a loss target) or not.

Why pieces: the preparing process tokenises each piece on its own (``add_special_tokens=False``)
and concatenates the ids, so a prompt is tokenised exactly as at inference (the chat template
with ``add_generation_prompt=True``) and a reply separately; the trained flag becomes the loss
mask. Templates are rendered with transformers' own jinja renderer and the tokenizer's special
tokens, so the text is what ``tokenizer.apply_chat_template`` gives, without importing a model.

Assistant spans come from growing-prefix rendering, not from ``{% generation %}`` tags (few
templates have them): for assistant turn i, P = render(messages[:i], add_generation_prompt=True)
and F = render(messages[:i+1]); the turn's text is F[len(P):], its trailing whitespace (ChatML's
"\\n" after <|im_end|>) left untrained. The full rendering must start with every F used; a
template that re-renders earlier turns (e.g. drops their reasoning) is a ConfigError suggesting
data.train_on=last, which needs only the last turn to render stably.

Choices: a conversation without an assistant turn has nothing to train and is skipped
(``pieces`` returns None; the caller counts it), except with train_on=all, where every text is
trained. In the prompt_completion layout only the completion is trained (train_on last and
assistant alike; all trains the prompt too). A message's content must be a string (None-valued
keys are dropped first, as apply_chat_template drops them); other keys (tool_calls,
reasoning_content...) reach the template unchanged.

Limit: the first reply's prompt, and with train_on=last the last one's, is one piece, so its ids
are the inference prompt's. A later reply's prompt holds earlier replies tokenised on their own;
it equals apply_chat_template's ids for that prompt only when the tokenizer tokenises a reply the
same alone and after its header (true of SmolLM2's and Llama 3's; GPT-2's split is not: see
tests/unit/data/test_chat_masks.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from fsdp_lab.config import ConfigError, first_line
from fsdp_lab.config.config_dirs import shipped
from fsdp_lab.internals import transformers_private

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
Pieces = list[tuple[str, bool]]


@dataclasses.dataclass
class ChatFormat:
    """How rows become pieces; plain data, sent as JSON to the preparing processes."""

    layout: Literal["messages", "prompt_completion"]
    template: str | None  # jinja source; None only for string prompt/completion rows
    template_vars: dict[str, str] = dataclasses.field(default_factory=dict)
    train_on: Literal["last", "assistant", "all"] = "assistant"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    bos: str | None = None  # string prompt/completion: opens the row where the tokenizer adds BOS

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChatFormat:
        return cls(**json.loads(text))


def detect_layout(
    columns: list[str],
    messages_column: str = "messages",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    source: str = "the data",
) -> str:
    """ "messages" when the conversation column is there, else "prompt_completion" when both of
    its columns are; ``source`` names the file in the error."""
    if messages_column in columns:
        return "messages"
    if prompt_column in columns and completion_column in columns:
        return "prompt_completion"
    raise ConfigError(
        f"data: {source} has columns {sorted(columns)}, neither data.messages_column="
        f"{messages_column!r} nor both data.prompt_column={prompt_column!r} and "
        f"data.completion_column={completion_column!r}; set those to the file's columns"
    )


def template_of(tokenizer, chat_template_setting: str | None) -> str:
    """The jinja source: the file named by data.chat_template, else the tokenizer's own."""
    if chat_template_setting:
        path = Path(chat_template_setting).expanduser()
        if not path.is_file() and (ours := shipped(chat_template_setting)) is not None:
            path = ours  # conf/chat_templates/...: the templates the package ships
        try:
            source, text = str(path), path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"data.chat_template: cannot read {chat_template_setting} ({first_line(e)}); "
                "set it to a .jinja file (fsdp_lab ships conf/chat_templates/chatml.jinja)"
            ) from None
    else:
        source, text = _tokenizer_template(tokenizer)
    _check_syntax(source, text)
    return text


def _tokenizer_template(tokenizer) -> tuple[str, str]:
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    text = getattr(tokenizer, "chat_template", None)
    if isinstance(text, dict):
        if "default" not in text:
            raise ConfigError(
                f"data.chat_template: the tokenizer at {name} has named chat templates "
                f"{sorted(text)} but no 'default'; set data.chat_template=<a .jinja file>"
            )
        text = text["default"]
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(
            f"data.chat_template: the tokenizer at {name} has no chat template; set "
            "data.chat_template=<a .jinja file> (fsdp_lab ships conf/chat_templates/chatml.jinja)"
        )
    return f"the chat template of {name}", text


def _check_syntax(source: str, text: str) -> None:
    """A syntax error stops the run before any process prepares data."""
    import jinja2

    try:
        transformers_private.compile_chat_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"data.chat_template: {source} is not a valid jinja template (line {e.lineno}: "
            f"{first_line(e)}); fix it or set data.chat_template=<a .jinja file>"
        ) from None


def template_vars_of(tokenizer) -> dict[str, str]:
    """The special tokens apply_chat_template passes to a template (bos_token, eos_token...)."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


def pieces(row, fmt: ChatFormat, where: Callable[[], str]) -> tuple[Pieces, bool] | None:
    """The row's pieces (their texts joined are the rendered row) and whether the caller must
    append the EOS id, trained; None for a row skipped (a conversation with no assistant turn).
    ``where()`` names the row ("FILE line N"), computed only for an error."""
    if not isinstance(row, dict):
        raise ConfigError(
            f"data.files: {where()} is a JSON {type(row).__name__}, not an object; each row "
            "must be an object"
        )
    if fmt.layout == "messages":
        if fmt.messages_column not in row:
            raise ConfigError(
                f"data.files: {where()} has no {fmt.messages_column!r} column (it has "
                f"{sorted(row)}); set data.messages_column to the conversation's column"
            )
        messages = _messages(row[fmt.messages_column], fmt.messages_column, where)
        return _conversation(messages, fmt, where)
    missing = [c for c in (fmt.prompt_column, fmt.completion_column) if c not in row]
    if missing:
        raise ConfigError(
            f"data.files: {where()} has no {' / '.join(map(repr, missing))} column (it has "
            f"{sorted(row)}); set data.prompt_column and data.completion_column"
        )
    return _prompt_completion(row[fmt.prompt_column], row[fmt.completion_column], fmt, where)


def _messages(value, column: str, where) -> list[dict]:
    """Checked messages, None-valued keys dropped (as apply_chat_template drops them)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"data.files: {where()}: {column!r} holds a {type(value).__name__}, not a list of "
            "messages; set data.messages_column to the conversation's column"
        )
    out = []
    for k, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(
                f"data.files: {where()}: message {k} of {column!r} is not an object with "
                "'role' and 'content'; fix the row"
            )
        if message["role"] not in ROLES:
            raise ConfigError(
                f"data.files: {where()}: unknown role {message['role']!r} in message {k}; "
                f"roles are {', '.join(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise ConfigError(
                f"data.files: {where()}: message {k} of {column!r} has content of type "
                f"{type(message['content']).__name__}; content must be a string"
            )
        out.append({key: v for key, v in message.items() if v is not None})
    return out


def render_prompt(messages: list[dict], fmt: ChatFormat, where: Callable[[], str]) -> str:
    """A conversation as the model is asked to continue it: rendered with the template's
    generation prompt (eval.prompts' chat prompts)."""
    try:
        checked = _messages(messages, "messages", where)
    except ConfigError as e:  # named by where(), not by data.files
        raise ConfigError(str(e).removeprefix("data.files: ")) from None
    return _render(checked, fmt, True, where)


def _render(messages: list[dict], fmt: ChatFormat, generation: bool, where) -> str:
    """What ``tokenizer.apply_chat_template(messages, tokenize=False)`` renders: the same
    renderer, with the special tokens as template variables."""
    from transformers.utils.chat_template_utils import render_jinja_template

    if fmt.template is None:  # string prompt/completion rows first, then a row of messages
        raise ConfigError(
            f"data.chat_template: {where()} holds messages, and the tokenizer has no chat "
            "template to render them; set data.chat_template=<a .jinja file> "
            "(conf/chat_templates/chatml.jinja), or keep the rows' prompts strings"
        )
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=fmt.template,
            add_generation_prompt=generation,
            **fmt.template_vars,
        )
    except Exception as e:  # noqa: BLE001 - a template raises anything (TemplateError, TypeError)
        raise ConfigError(
            f"data.chat_template: the template fails on {where()} ({first_line(e)}); fix the "
            "row or set data.chat_template=<a .jinja file> that accepts it"
        ) from None
    return rendered[0]


def _conversation(messages: list[dict], fmt: ChatFormat, where) -> tuple[Pieces, bool] | None:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns and fmt.train_on != "all":
        return None
    full = _render(messages, fmt, False, where)
    if fmt.train_on == "all":
        return _cover(full, [(0, len(full))]), False
    trained = turns if fmt.train_on == "assistant" else turns[-1:]
    spans = [_span(messages[:i], messages[: i + 1], full, fmt, where) for i in trained]
    return _cover(full, spans), False


def _span(before: list[dict], through: list[dict], full: str, fmt, where) -> tuple[int, int]:
    """Where the reply that ``through`` adds to ``before`` lies in ``full``: from the end of
    the generation prompt to the end of the turn, trailing whitespace left out."""
    prompt = _render(before, fmt, True, where)
    turn = _render(through, fmt, False, where)
    if not turn.startswith(prompt):
        raise ConfigError(
            f"data.chat_template: on {where()} the template's generation prompt for assistant "
            f"message {len(before)} is not the start of that message's rendering; use a "
            "template whose add_generation_prompt output is the assistant turn's header"
        )
    if not full.startswith(turn):
        raise ConfigError(
            f"data.chat_template: on {where()} the template renders assistant message "
            f"{len(before)} differently once later messages follow (e.g. it drops earlier "
            "turns' reasoning); set data.train_on=last or another data.chat_template"
        )
    return len(prompt), len(prompt) + len(turn[len(prompt) :].rstrip())


def _cover(text: str, spans: list[tuple[int, int]]) -> Pieces:
    """Pieces covering ``text`` exactly: the spans trained, the gaps between them not."""
    out, at = [], 0
    for start, stop in spans:
        if start < at:
            raise ConfigError(
                "data.chat_template: the template's assistant turns overlap; use another "
                "data.chat_template"
            )
        out += [(text[at:start], False), (text[start:stop], True)]
        at = stop
    out.append((text[at:], False))
    out = [(t, trained) for t, trained in out if t]
    assert "".join(t for t, _ in out) == text
    return out


def _prompt_completion(prompt, completion, fmt: ChatFormat, where) -> tuple[Pieces, bool] | None:
    """String fields: the prompt untrained (after the BOS the tokenizer adds by default, if any),
    the completion and an EOS trained (unless the completion ends with the EOS text already); a
    blank completion has nothing to learn: None, skipped. Lists of
    messages (TRL's conversational prompt-completion): the completion's span is what the
    completion adds to the prompt's generation prompt; its end-of-turn ends it, no EOS."""
    everything = fmt.train_on == "all"
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            return None  # no reply to learn: skipped and counted, as a conversation without one
        eos = fmt.template_vars.get("eos_token")
        ends = bool(eos) and completion.endswith(eos)  # it brings its own EOS (as TRL checks)
        # The BOS the tokenizer adds to a text by default (Llama's), as at inference.
        opened = [(fmt.bos, everything)] if fmt.bos else []
        texts = [*opened, (prompt, everything), (completion, True)]
        return [(t, f) for t, f in texts if t], not ends
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        before = _messages(prompt, fmt.prompt_column, where)
        after = _messages(completion, fmt.completion_column, where)
        if not after:
            raise ConfigError(
                f"data.files: {where()}: {fmt.completion_column!r} is an empty list of "
                "messages; fix or remove the row"
            )
        full = _render(before + after, fmt, False, where)
        if everything:
            return _cover(full, [(0, len(full))]), False
        return _cover(full, [_span(before, before + after, full, fmt, where)]), False
    raise ConfigError(
        f"data.files: {where()}: {fmt.prompt_column!r} is a {type(prompt).__name__} and "
        f"{fmt.completion_column!r} a {type(completion).__name__}; both must be strings or "
        "both lists of messages"
    )
