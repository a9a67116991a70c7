# Two entry points: `make demo` and `make test`. Both bootstrap .venv from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: .venv venv demo test lint browser bench bench-all clean

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

test: $(STAMP) browser lint
	$(VENV)/bin/pytest -q

# Style and types are checked before the tests (all configured in pyproject.toml): ruff's lint rules, its
# formatter's check, then pyright (basic) over tpubuild/. PYRIGHT_PYTHON_IGNORE_WARNINGS: no look-up of a
# newer pyright on PyPI (the pinned one runs from its wheel).
LINTED := tpubuild tests bench models dodo.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

# Headless Chromium for the report page tests (tests/test_report.py), installed from Debian when
# missing and we are root (CI on a fresh machine); otherwise those tests skip.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium not found (not root, or no apt-get): the report page tests will skip"; fi; }

# docs/benchmarks.md, generated: the bench scripts that declare PAGE (bench/page.py), a quick subset or all
bench: $(STAMP)
	$(VENV)/bin/python bench/page.py

bench-all: $(STAMP)
	$(VENV)/bin/python bench/page.py --all

clean:
	-$(VENV)/bin/doit clean
	rm -rf build
