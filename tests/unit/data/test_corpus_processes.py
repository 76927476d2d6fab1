"""Preparation as processes see it: memory that does not grow with the corpus, one preparer
with the others waiting, a killed preparer continued by the next run, a full disk. Each
preparation here runs in a fresh ``python`` of its own, as a launcher would (a preparing process
killed under train.py is in tests/integration/test_data_runs.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
# A launcher in miniature: prepare the corpus of the config in argv[1]; print its fingerprint,
# the process's own peak RSS and its preparing processes' (from the cache entry's meta).
SCRIPT = """
import json, logging, resource, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from fsdp_lab.config import ConfigError, to_typed
from fsdp_lab.data import corpus
cfg = to_typed(json.loads(sys.argv[1]))
tok = corpus.load_tokenizer(cfg)
try:
    c = corpus.prepare(cfg, tok, vocab_size=len(tok))
except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
meta = json.loads((c.path / "meta.json").read_text())
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"fingerprint": c.fingerprint, "launcher_kb": hwm,
                  "worker_kb": meta["peak_rss_per_process"] // 1024}))
"""


def config(cache: Path, files: list[Path], **data) -> str:
    data = {"kind": "text", "files": [str(f) for f in files], "cache_dir": str(cache), **data}
    return json.dumps({"data": data, "trainer": {"seq_len": 64}, "model": {"arch": "llama"}})


def start(cfg: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, cfg],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, code: int = 0) -> tuple[dict | None, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, f"exit {proc.returncode}\n{out}\n{err}"
    return (json.loads(out.splitlines()[-1]) if code == 0 else None), err


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """JSON lines of made-up words, about ``megabytes`` MB."""
    rng = np.random.default_rng(seed)
    words = np.array(["".join(rng.choice(list("etaoinshrdlu"), n)) for n in range(1, 9)] * 40)
    with path.open("w") as f:
        written = 0
        while written < megabytes * 1e6:
            picks = words[rng.integers(0, len(words), (200, 300))]
            lines = "".join(json.dumps({"text": " ".join(row)}) + "\n" for row in picks)
            f.write(lines)
            written += len(lines)
    return path


@pytest.fixture(scope="module")
def corpus_10mb(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "c.jsonl", 10)


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    peaks = {}
    for mb in (20, 80):
        corpus = write_corpus(tmp_path / f"{mb}.jsonl", mb, seed=mb)
        peaks[mb], _ = finish(start(config(tmp_path / "cache", [corpus])))
    for who in ("launcher_kb", "worker_kb"):
        small, large = peaks[20][who], peaks[80][who]
        assert large <= 1.15 * small, (who, peaks)  # 4x the corpus, the same memory


def test_one_process_prepares_and_the_other_waits_for_it(tmp_path, corpus_10mb, bpe_tokenizer):
    cfg = config(tmp_path / "cache", [corpus_10mb], tokenizer=bpe_tokenizer, num_proc=1)
    first, second = start(cfg), start(cfg)
    (a, err_a), (b, err_b) = finish(first), finish(second)
    assert a["fingerprint"] == b["fingerprint"]
    logs = err_a + err_b
    assert logs.count("data: preparing") == 1 and "data: waiting for pid" in logs, logs


def test_a_killed_preparer_is_continued_by_the_next_run(tmp_path, corpus_10mb, bpe_tokenizer):
    cache = tmp_path / "cache"
    cfg = config(cache, [corpus_10mb], tokenizer=bpe_tokenizer, num_proc=1)
    proc = start(cfg)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        progress = list(cache.glob(".tokens-*.partial/progress.json"))
        if progress and json.loads(progress[0].read_text())["appended"] >= 1:
            break
        time.sleep(0.02)
    workers = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert workers and not list(cache.glob("tokens-*/meta.json"))  # killed midway
    for pid in workers:  # the preparing processes die with their launcher
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    again, err = finish(start(cfg))
    assert "stopped preparing" in err and "continuing a stopped preparation: " in err, err
    fresh, _ = finish(start(config(tmp_path / "fresh", [corpus_10mb], tokenizer=bpe_tokenizer)))
    assert again["fingerprint"] == fresh["fingerprint"]


# A 4 MB tmpfs over the cache dir, in a user and mount namespace of the preparation's own (no
# root needed, nothing to unmount); what it left there is listed before the namespace goes.
FULL_DISK = """
mount -t tmpfs -o size=4M tmpfs "$1" || exit 97
"$2" -c "$3" "$4"; code=$?
find "$1" -path "*tokens-*/meta.json"
exit $code
"""


def test_a_full_disk_is_one_line_and_the_work_is_kept(tmp_path):
    cache = tmp_path / "small"
    cache.mkdir()
    corpus = write_corpus(tmp_path / "c.jsonl", 3)  # 6 MB of byte-level tokens
    shell = [
        "sh",
        "-c",
        FULL_DISK,
        "sh",
        str(cache),
        sys.executable,
        SCRIPT,
        config(cache, [corpus]),
    ]
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", *shell],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 97 or "unshare:" in proc.stderr:  # no user namespaces on this kernel
        pytest.fail(f"cannot mount a small tmpfs in a user namespace: {proc.stderr.strip()}")
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    line = proc.stderr.strip().splitlines()[-1]
    assert "No space left on device" in line and "data.cache_dir" in line, proc.stderr
    assert "prepared so far are kept in" in line
    assert not proc.stdout.strip()  # no entry was published as complete
