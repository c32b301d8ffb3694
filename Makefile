# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench clean

setup: $(STAMP)

# Re-installs only when pyproject.toml changes; a second run does nothing.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) examples/image_qa.py

bench: $(STAMP)
	$(PY) -m mmkv.bench cache --json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
