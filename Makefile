# The README's two commands: `make demo` (the main job) and `make test` (the suite).
# Both create .venv when missing and install what they need into it.
empty :=
space := $(empty) $(empty)
PYTHON ?= python3
TORCH ?= torch==2.13.0
# Optional package index for torch, e.g. https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp names the torch spec, so `make TORCH=torch==2.11.0 test` reinstalls torch
# instead of silently keeping the one installed before.
STAMP := $(VENV)/.installed-$(subst <,lt,$(subst >,gt,$(subst =,-,$(subst $(space),_,$(TORCH)))))

.PHONY: demo test lint bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchgpu train --example housing

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m mypy --strict src

bench: $(STAMP)
	bash benchmarks/run.sh

# The GPU check on a GPU machine with nothing installed (no venv): PART=default|rest|all|
# tests|bench|lm|train|multi, DRY_RUN=1 prints the commands, OUT=DIR packs the results
# (benchmarks/gpu/).
PART ?= default
gpu-check:
	PART=$(PART) DRY_RUN=$(DRY_RUN) bash benchmarks/gpu.sh

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
