# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint typecheck unit verify-units bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,torch]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

# systemd-analyze verify on every unit (against the venv's console scripts), sysusers and
# tmpfiles snippets applied to a scratch root: any output fails (systemd/verify.sh).
verify-units: $(STAMP)
	systemd/verify.sh $(BIN)

test: verify-units lint typecheck unit

demo: $(STAMP)
	$(BIN)/python -m slicer.demo

bench: $(STAMP)
	$(BIN)/python bench/handoff.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
