# Two entry points: `make demo` and `make test`. Both bootstrap .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: .venv venv demo test bench clean

.venv venv: $(STAMP)

# The venv itself: created only if absent (an existing one is reused as is).
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when pyproject.toml changes; the stamp makes an up-to-date venv a no-op.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/doit compile:demo_cnn

test: $(STAMP)
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(VENV)/bin/python bench/noop_rebuild.py

clean:
	-$(VENV)/bin/doit clean
	rm -rf build
