"""Test-wide settings. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here, first."""
import os

if not os.environ.get("MPPO_TEST_ON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run on 2 CPU cores shared by several processes: one intra-op thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
