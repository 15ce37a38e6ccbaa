# make demo: fresh venv, install, train the bundled default (byte-level GPT on Tiny Shakespeare, ~4 min on 2 CPU cores)
# make test: fresh venv, install, run the test suite
# make gpu-check: the GPU acceptance run, benchmarks/gpu_check.py (< 8 min on one GPU; exits 0 saying so without one).
#   It installs nothing: .venv's python when that imports torch, else python3. ARGS="--stages throughput,vs_hf".
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# On machines without CUDA, pin the CPU build of torch first so pip does not pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install demo test lint clean gpu-check

$(PY):
	python3 -m venv $(VENV)

install: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"

demo: install
	$(VENV)/bin/shardlm train out_dir=runs/demo

test: install
	$(PY) -m ruff check shardlm tests benchmarks
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check shardlm tests benchmarks

gpu-check:
	@py=$(PY); $$py -c "import torch" 2>/dev/null || py=python3; $$py benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
