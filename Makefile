# Set-up and everyday commands. torch is installed first, pinned here only: 2.13.0 resolves to the local
# CPU wheel on the project machines; on a GPU box set TORCH_VERSION / TORCH_INDEX to a CUDA build.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
VENV ?= .venv
# more options for a bench target: make bench-spec ARGS=--assisted
ARGS ?=
# the interpreter the venv is made from: 3.11 or newer (pyproject's requires-python)
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL ?= smollm2-135m-instruct
PROMPT ?= Explain speculative decoding in two sentences.

.PHONY: install pull serve run test lint bench-ar bench-spec bench-batch bench-overhead clean

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "$(PYTHON) is older than 3.11: make PYTHON=python3.11 ..." >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e ".[dev,bench,load]"
	touch $@

install: $(VENV)/.installed

pull: install
	$(VENV)/bin/specserve models pull $(MODEL)

serve: pull
	$(VENV)/bin/serve run deployments/app.yaml

run: pull
	$(VENV)/bin/specserve generate --model $(MODEL) "$(PROMPT)"

test: pull
	SPECSERVE_LOAD_TEST=1 $(PY) -m pytest -q --durations=10

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy specserve deployments load

bench-ar: pull
	$(VENV)/bin/specserve bench ar --out bench_out/ar $(ARGS)

bench-spec: pull
	$(VENV)/bin/specserve bench spec --pairs smollm2-int8 --out bench_out/spec $(ARGS)

bench-batch: pull
	$(VENV)/bin/specserve bench batch --out bench_out/batch $(ARGS)

bench-overhead: pull
	$(VENV)/bin/specserve bench overhead --pair smollm2-int8 --batch 1 16 --max-tokens 32 --repeats 2 $(ARGS)

clean:
	rm -rf $(VENV) bench_out
