# The front doors: `make demo` (RL on a real pretrained model on the CPU), `make demo-tiny` (the from-scratch tiny
# model, the fast path) and `make test` (the whole test suite, as CI runs it).
# Both create .venv when missing and install mppo with the CPU constraints (torch pinned to the CPU wheel);
# `make test` adds SGLang's CPU tier (`make sglang`).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints-cpu.txt
STAMP := $(VENV)/.mppo-installed
SGLANG_REQS := requirements-sglang-cpu.txt
SGLANG_STAMP := $(VENV)/.mppo-sglang-installed
# torchvision goes here, off sys.path (see mppo/rollout/sglang_cpu/__init__.py: PyPI's build is CUDA-linked).
SGLANG_EXTRAS := $(VENV)/mppo-sglang-cpu
PYTEST_ARGS ?=

.PHONY: demo demo-tiny test test-gpu install sglang clean

install: $(STAMP)

$(STAMP): setup.py mppo/versions.py $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip
	# torch first, from the constraints, so no dependency can resolve a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$$(grep -E '^torch==' $(CONSTRAINTS))"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	$(BIN)/python -m pip list 2>/dev/null | grep -E '^(torch|megatron-core|triton|transformers) '
	touch $@

# SGLang 0.5.23's CPU tier (the test suite runs the trainer against a real sglang.Engine on the CPU). sglang goes in
# without its declared requirements (a CUDA torch 2.14.1 and CUDA kernels), then what its CPU engine imports, with
# torch held by the constraints and transformers/tokenizers/numpy held at what `install` resolved. Downloads are
# cached by pip (~/.cache/pip).
sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP) $(SGLANG_REQS) $(CONSTRAINTS)
	$(BIN)/python -m pip install -q --no-deps "$$(grep -E '^sglang==' $(SGLANG_REQS))"
	$(BIN)/python -m pip freeze | grep -iE '^(transformers|tokenizers|huggingface[-_]hub|numpy|safetensors)==' \
		> $(VENV)/held-for-sglang.txt
	grep -vE '^(sglang|torchvision)==' $(SGLANG_REQS) > $(VENV)/sglang-cpu-requirements.txt
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -c $(VENV)/held-for-sglang.txt \
		-r $(VENV)/sglang-cpu-requirements.txt
	rm -rf $(SGLANG_EXTRAS)
	$(BIN)/python -m pip install -q --no-deps --target $(SGLANG_EXTRAS) "$$(grep -E '^torchvision==' $(SGLANG_REQS))"
	# torch must still be the CPU wheel, and sglang must start on it (stand-ins: mppo/rollout/sglang_cpu)
	$(BIN)/python -c "import torch, sys; sys.exit(f'torch {torch.__version__} is a CUDA build' if torch.version.cuda else 0)"
	$(BIN)/python -c "from mppo.rollout.sglang_cpu import activate; activate(); import sglang.srt.entrypoints.engine"
	$(BIN)/python -m pip list 2>/dev/null | grep -E '^(torch|transformers|sglang) '
	touch $@

demo: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" bash launch/demo.sh

demo-tiny: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" RUN_DIR="$${RUN_DIR:-runs/demo-tiny}" bash launch/demo_cpu.sh

# Two pytest-xdist workers (a file's tests on one worker, files in tests/conftest.py's order: xdist would otherwise
# start the files with the most tests first and leave the few long ones for the end), then the tests that measure
# the machine, alone; both parts always run, and `make test` fails if either does (exit 5: PYTEST_ARGS selected
# none of a part's tests).
test: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" $(PYTEST_ARGS); \
	parallel=$$?; \
	$(BIN)/python -m pytest tests -m serial $(PYTEST_ARGS); serial=$$?; \
	for code in $$parallel $$serial; do [ $$code -eq 0 ] || [ $$code -eq 5 ] || exit $$code; done

# The GPU tier: on a machine with CUDA and the GPU stack already installed (not run by CI, which has no GPU).
test-gpu:
	MPPO_TEST_ON_GPU=1 python3 -m pytest tests/gpu tests/test_kernels_triton.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
