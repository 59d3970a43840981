# Two entry points that work on a bare CPU machine with Python >= 3.11 (see README):
#   make demo   install, train softmax and conformal quickstart models on the embedded corpus, plot both
#   make test   install, run the test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install test demo lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 -q

demo: $(STAMP)
	PYTHON=$(abspath $(PY)) bash experiments/demo.sh

lint: $(STAMP)
	$(PY) -m ruff check .
