"""GPU tier (`make test-gpu`, or `pytest tests/gpu`): run only where CUDA is available; `pytest tests` (CI, CPU)
does not collect this folder (pytest.ini norecursedirs). MPPO_TEST_ON_GPU makes tests/conftest.py leave
TRITON_INTERPRET unset so Triton compiles for the GPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.exit("tests/gpu needs a CUDA device; the CPU suite is `pytest tests`", returncode=2)

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.exit("tests/gpu compiles Triton for the GPU: run it with MPPO_TEST_ON_GPU=1 (make test-gpu sets it) and "
                "without TRITON_INTERPRET=1", returncode=2)
