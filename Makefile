# The front doors: `make demo` (RL on a real pretrained model on the CPU), `make demo-tiny` (the from-scratch tiny
# model, the fast path) and `make test` (the whole test suite, as CI runs it).
# Both create .venv when missing and install mppo with the CPU constraints (torch pinned to the CPU wheel).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints-cpu.txt
STAMP := $(VENV)/.mppo-installed
PYTEST_ARGS ?=

.PHONY: demo demo-tiny test test-gpu install clean

install: $(STAMP)

$(STAMP): setup.py $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	# torch first, from the constraints, so no dependency can resolve a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$$(grep -E '^torch==' $(CONSTRAINTS))"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	$(BIN)/python -m pip list 2>/dev/null | grep -E '^(torch|megatron-core|triton|transformers) '
	touch $@

demo: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" bash launch/demo.sh

demo-tiny: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" RUN_DIR="$${RUN_DIR:-runs/demo-tiny}" bash launch/demo_cpu.sh

test: $(STAMP)
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

# The GPU tier: on a machine with CUDA and the GPU stack already installed (not run by CI, which has no GPU).
test-gpu:
	MPPO_TEST_ON_GPU=1 python3 -m pytest tests/gpu tests/test_kernels_triton.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
