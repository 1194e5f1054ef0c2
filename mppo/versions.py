"""The megatron-core releases mppo runs on: one declaration for setup.py (which reads this file as text, before
anything is installed), `mppo doctor` and the tests.

`mppo/parallel/cpu_compat.py` patches megatron-core internals (CUDA calls on a CPU machine, a Transformer Engine
name), so a release the patches were not probed on may break them silently. The supported range is therefore the
tested one: every patch's probe (tests/test_models_parallel.py, tests/test_models_moe.py) ran on PROVEN_ON, and
that test fails when the installed release is another, so moving the range means rerunning the probes there."""
from __future__ import annotations

MEGATRON_CORE_SUPPORTED = ">=0.16.1,<0.17"  # PEP 440; 0.17+ declare Python >= 3.12 and are untested here
MEGATRON_CORE_PROVEN_ON = "0.16.1"  # the release CI (and the GPU device script's wheel) runs the probes on
