"""Chat rows as trained/untrained pieces (fsdp_lab.data.chat), checked through real tokenizers:
the pieces tokenised one by one (as the preparing process does) must train exactly each
assistant reply and its end-of-turn token, decode to what apply_chat_template renders, and give
the prompt before each reply the ids it has at inference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fsdp_lab.config import ConfigError
from fsdp_lab.data.chat import ChatFormat, detect_layout, pieces, template_of, template_vars_of

WHERE = "data.jsonl line 7"

SYSTEM = [{"role": "system", "content": "You answer in French."}]
TURNS = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Bonjour !"},
    {"role": "user", "content": "List two colours,\nplease."},
    {"role": "assistant", "content": "- rouge\n- vert  (é, 🙂)"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "De rien."},
]
CONVERSATIONS = [SYSTEM + TURNS, TURNS, SYSTEM + TURNS + [{"role": "user", "content": "Bye"}]]


@pytest.fixture(scope="module")
def smollm2_tok(smollm2):
    """SmolLM2's real tokenizer and chat template (no generation tags), and its end of turn."""
    return AutoTokenizer.from_pretrained(smollm2), "<|im_end|>"


# Llama 3's pre-tokenizer split: "\n\n" is one piece whether text follows it or not, so a reply
# tokenised alone and the same reply inside a later prompt give the same ids.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def toy_llama3(split: str | None) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few strings, with llama3.jinja's special tokens;
    ``split`` None: GPT-2's pre-tokenizer split instead of Llama 3's."""
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is not None:
        pattern = pre_tokenizers.Split(Regex(split), behavior="isolated")
        byte_level = pre_tokenizers.Sequence([pattern, byte_level])
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for m in SYSTEM + TURNS] * 20 + ["user assistant system\n\n"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = template_of(fast, "conf/chat_templates/llama3.jinja")
    return fast


@pytest.fixture(scope="module")
def llama3():
    return toy_llama3(LLAMA3_SPLIT), "<|eot_id|>"


@pytest.fixture(params=["smollm2_tok", "llama3"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def fmt_of(tok, train_on="assistant", layout="messages", **kw) -> ChatFormat:
    return ChatFormat(layout, template_of(tok, None), template_vars_of(tok), train_on, **kw)


def encode(tok, parts) -> tuple[list[int], list[bool]]:
    """Each piece tokenised alone and concatenated, as the preparing process does."""
    ids, mask = [], []
    for text, trained in parts:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def trained_runs(mask) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, flag in enumerate([*mask, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check(tok, eot, messages, ids, mask, trained_turns) -> None:
    """Trained tokens are exactly the replies of ``trained_turns`` + end-of-turn; the prompt
    before each is the inference prompt; all ids decode to the template's rendering."""
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    runs = trained_runs(mask)
    assert [tok.decode(ids[a:b]) for a, b in runs] == [
        messages[i]["content"] + eot for i in trained_turns
    ]
    for (start, _), i in zip(runs, trained_turns, strict=True):
        prompt = tok.apply_chat_template(
            messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids[:start] == prompt


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("train_on", ["assistant", "last"])
def test_assistant_replies_are_trained(tokenizer, conv, train_on):
    tok, eot = tokenizer
    messages = CONVERSATIONS[conv]
    parts, eos = pieces({"messages": messages}, fmt_of(tok, train_on), lambda: WHERE)
    assert not eos
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    ids, mask = encode(tok, parts)
    check(tok, eot, messages, ids, mask, replies if train_on == "assistant" else replies[-1:])


def test_train_on_last_prompt_is_the_inference_prompt_with_any_tokenizer():
    """GPT-2's split tokenises "\n\n" at a prompt's end apart from the reply, but merges
    "\n\nBonjour" as "\n", "\n", "Bonjour" inside a later prompt: a sequence training every
    reply cannot match every later inference prompt, but the last reply's prompt is one
    untrained piece, tokenised exactly as at inference."""
    tok = toy_llama3(None)
    messages = SYSTEM + TURNS
    ids, mask = encode(tok, pieces({"messages": messages}, fmt_of(tok, "last"), lambda: WHERE)[0])
    check(tok, "<|eot_id|>", messages, ids, mask, [len(messages) - 1])
    ids, mask = encode(tok, pieces({"messages": messages}, fmt_of(tok), lambda: WHERE)[0])
    later = tok.apply_chat_template(messages[:4], add_generation_prompt=True, return_dict=False)
    assert ids[: trained_runs(mask)[1][0]] != later  # the limit this test documents


def test_train_on_all_trains_the_whole_rendering(tokenizer):
    tok, _ = tokenizer
    messages = SYSTEM + TURNS
    parts, eos = pieces({"messages": messages}, fmt_of(tok, "all"), lambda: WHERE)
    assert parts == [(tok.apply_chat_template(messages, tokenize=False), True)] and not eos
    ids, mask = encode(tok, parts)
    assert all(mask)
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)


def test_chatml_template_with_a_system_turn(smollm2_tok):
    tok, eot = smollm2_tok
    fmt = ChatFormat("messages", template_of(tok, "conf/chat_templates/chatml.jinja"), {})
    parts, _ = pieces({"messages": SYSTEM + TURNS}, fmt, lambda: WHERE)
    # SmolLM2's template is ChatML too: with a system turn both render the same text
    assert "".join(t for t, _ in parts) == tok.apply_chat_template(SYSTEM + TURNS, tokenize=False)
    assert [t for t, trained in parts if trained] == [
        m["content"] + eot for m in TURNS if m["role"] == "assistant"
    ]
    assert parts[-1] == ("\n", False)


def test_a_conversation_without_a_reply_is_skipped(smollm2_tok):
    tok, _ = smollm2_tok
    row = {"messages": SYSTEM + TURNS[:1]}
    assert pieces(row, fmt_of(tok, "assistant"), lambda: WHERE) is None
    assert pieces(row, fmt_of(tok, "last"), lambda: WHERE) is None
    assert pieces(row, fmt_of(tok, "all"), lambda: WHERE)[0][0][1]  # all: trained text


def test_prompt_completion_strings():
    row = {"prompt": "2+2=", "completion": " 4", "id": 3}
    fmt = ChatFormat("prompt_completion", None, train_on="assistant")
    assert pieces(row, fmt, lambda: WHERE) == ([("2+2=", False), (" 4", True)], True)
    fmt.train_on = "all"
    assert pieces(row, fmt, lambda: WHERE) == ([("2+2=", True), (" 4", True)], True)
    fmt = ChatFormat("prompt_completion", None, prompt_column="q", completion_column="a")
    assert pieces({"q": "x", "a": "y"}, fmt, lambda: WHERE) == ([("x", False), ("y", True)], True)


def test_conversational_prompt_completion(tokenizer):
    tok, eot = tokenizer
    prompt, completion = SYSTEM + TURNS[:3], TURNS[3:4]
    row = {"prompt": prompt, "completion": completion}
    parts, eos = pieces(row, fmt_of(tok, layout="prompt_completion"), lambda: WHERE)
    assert not eos
    ids, mask = encode(tok, parts)
    check(tok, eot, prompt + completion, ids, mask, [len(prompt)])


def test_format_round_trips_through_json(smollm2_tok):
    fmt = fmt_of(smollm2_tok[0], "last", messages_column="conversation")
    assert ChatFormat.from_json(fmt.to_json()) == fmt


def test_detect_layout():
    assert detect_layout(["messages", "prompt", "completion"]) == "messages"
    assert detect_layout(["prompt", "completion", "x"]) == "prompt_completion"
    assert (
        detect_layout(["q", "a"], prompt_column="q", completion_column="a") == "prompt_completion"
    )
    with pytest.raises(ConfigError, match=r"data.jsonl has columns \['prompt', 'text'\]"):
        detect_layout(["text", "prompt"], source="data.jsonl")


ALTERNATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
    "['role'] %}{{ raise_exception('Conversation roles must alternate\\nuser/assistant') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Earlier replies lose their text once a later one follows (as reasoning templates drop
# earlier turns' reasoning).
DROPS_EARLIER = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['role'] != 'assistant' or loop.last %}"
    "{{ m['content'] }}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}"
)
OTHER_HEADER = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}[bot]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
BAD_ROWS = [
    ("messages", ALTERNATE, {"messages": [1]}, r"message 0 of 'messages' is not an object"),
    ("messages", ALTERNATE, {"messages": [{"role": "user"}]}, r"message 0 .* 'role' and 'content'"),
    ("messages", ALTERNATE, {"messages": "hi"}, r"'messages' holds a str, not a list"),
    ("messages", ALTERNATE, {"text": "hi"}, r"no 'messages' column \(it has \['text'\]\)"),
    ("messages", ALTERNATE, [1, 2], r"is a JSON list, not an object"),
    (
        "messages",
        ALTERNATE,
        {"messages": [*MESSAGES, {"role": "bot", "content": "c"}]},
        r"unknown role 'bot' in message 2; roles are system, developer, user, assistant, tool",
    ),
    (
        "messages",
        ALTERNATE,
        {"messages": [{"role": "user", "content": ["a"]}]},
        r"content of type list; content must be a string",
    ),
    (
        "messages",
        ALTERNATE,
        {"messages": [MESSAGES[0], *MESSAGES]},
        r"^data.chat_template: the template fails on data.jsonl line 7 \(Conversation roles "
        r"must alternate\);",
    ),
    ("messages", DROPS_EARLIER, {"messages": MESSAGES * 2}, r"set data.train_on=last"),
    (
        "messages",
        OTHER_HEADER,
        {"messages": MESSAGES},
        r"generation prompt for assistant message 1",
    ),
    (
        "prompt_completion",
        ALTERNATE,
        {"prompt": "a", "other": 1},
        r"no 'completion' column \(it has \['other', 'prompt'\]\); set data.prompt_column and "
        r"data.completion_column",
    ),
    ("prompt_completion", ALTERNATE, {"prompt": "a", "completion": MESSAGES}, r"both must be"),
    ("prompt_completion", ALTERNATE, {"prompt": MESSAGES, "completion": []}, r"empty list"),
]


@pytest.mark.parametrize(("layout", "template", "row", "match"), BAD_ROWS)
def test_a_bad_row_is_one_line_naming_it(layout, template, row, match):
    fmt = ChatFormat(layout, template, {}, "assistant")
    with pytest.raises(ConfigError, match=match) as e:
        pieces(row, fmt, lambda: WHERE)
    assert WHERE in str(e.value) and "\n" not in str(e.value)


def test_train_on_last_needs_only_the_last_reply_stable():
    fmt = ChatFormat("messages", DROPS_EARLIER, {}, "last")
    parts, _ = pieces({"messages": MESSAGES * 2}, fmt, lambda: WHERE)
    assert [t for t, trained in parts if trained] == ["b</s>"]
    assert "".join(t for t, _ in parts) == "<user>a</s><assistant></s><user>a</s><assistant>b</s>"


def test_template_of(tmp_path, smollm2_tok):
    tok, _ = smollm2_tok
    assert template_of(tok, None) == tok.chat_template
    mine = tmp_path / "t.jinja"
    mine.write_text(ALTERNATE)
    assert template_of(tok, str(mine)) == ALTERNATE
    assert "<|im_start|>" in template_of(None, "conf/chat_templates/chatml.jinja")
    named = SimpleNamespace(name_or_path="org/m", chat_template={"default": "x", "tool_use": "y"})
    assert template_of(named, None) == "x"
    bad = [
        (None, str(tmp_path / "none.jinja"), r"cannot read .*none.jinja"),
        (SimpleNamespace(name_or_path="org/m", chat_template=None), None, r"at org/m has no chat"),
        (SimpleNamespace(name_or_path="org/m", chat_template={"a": "x"}), None, r"\['a'\]"),
        (SimpleNamespace(name_or_path="org/m", chat_template="{% for %}"), None, r"not a valid"),
    ]
    for tokenizer, setting, match in bad:
        with pytest.raises(ConfigError, match=match) as e:
            template_of(tokenizer, setting)
        assert str(e.value).startswith("data.chat_template: ") and "\n" not in str(e.value)
