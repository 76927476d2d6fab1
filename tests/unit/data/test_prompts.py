"""eval.prompts: a list, a .jsonl or a text file, read and checked in one line each; chat
prompts rendered by the chat template with its generation prompt; no EOS after a prompt."""

from __future__ import annotations

import json

import pytest

from fsdp_lab.config import ConfigError
from fsdp_lab.data.prompts import encode_prompts, read_prompts

CHAT = [{"role": "user", "content": "Hi"}]


def test_list_jsonl_and_text_files(tmp_path):
    assert read_prompts(["a", "b"]) == ["a", "b"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps(x) for x in ["plain", {"prompt": "keyed"}, {"messages": CHAT}]) + "\n"
    )
    assert read_prompts(str(jsonl)) == ["plain", "keyed", CHAT]
    # one JSON list of prompts, as a user writes it (strings or conversations)
    whole = tmp_path / "prompts.json"
    whole.write_text(json.dumps(["plain", CHAT, {"prompt": "keyed"}], indent=2))
    assert read_prompts(str(whole)) == ["plain", CHAT, "keyed"]
    one_chat = tmp_path / "chat.json"  # a list of messages alone: one conversation
    one_chat.write_text(json.dumps(CHAT, indent=2))
    assert read_prompts(str(one_chat)) == [CHAT]
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo words\n")
    assert read_prompts(str(text)) == ["one", "two words"]
    assert read_prompts(None) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('"ok"\n{not json\n', "line 2 is not JSON"),
        ('{"text": "no prompt key"}\n', "line 1 is not a prompt"),
        ('[{"role": "user"}]\n', "item 0 is not a prompt"),
        ("\n\n", "holds no prompt"),
        ('["ok", 3]\n', "item 1 is not a prompt"),
        ("[]\n", "holds no prompt"),
    ],
)
def test_a_bad_prompt_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        read_prompts(str(path))
    assert "\n" not in str(e.value)


def test_a_missing_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.prompts=.*missing.jsonl: cannot read it"):
        read_prompts(str(tmp_path / "missing.jsonl"))


def test_chat_prompts_take_the_template_with_its_generation_prompt():
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer(extra_ids=0)
    with pytest.raises(ConfigError, match=r"eval\.prompts holds chat messages, but the tokenizer"):
        encode_prompts([CHAT], tok, None)
    [plain, chat] = encode_prompts(["Hi", CHAT], tok, "conf/chat_templates/chatml.jinja")
    assert plain.ids == tok("Hi", add_special_tokens=False)["input_ids"]  # no EOS after it
    assert chat.text.endswith("<|im_start|>assistant\n")
    assert chat.ids == tok(chat.text, add_special_tokens=False)["input_ids"]
