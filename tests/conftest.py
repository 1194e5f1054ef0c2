"""Test-wide settings. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here, first.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile`: a file's tests stay together, so its
module fixtures, often one shared torchrun launch, are made once), then the tests marked `serial` alone.
"""
import os

if not os.environ.get("MPPO_TEST_ON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run on 2 CPU cores shared by several processes: one intra-op thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The files that take longest (2026-12-08, slowest first), started first: with them last, one worker ends the run
# alone on a long file while the other idles (the Makefile passes --no-loadscope-reorder, or xdist would start the
# files with the most tests first).
SLOW_FILES_FIRST = ["test_trainer_sglang", "test_demo", "test_trainer_async", "test_real_model",
                    "test_workers_parallel", "test_trainer_moe", "test_trainer_e2e", "test_rollout_sglang_cpu",
                    "test_multinode", "test_weight_sync", "test_bench_step", "test_doctor", "test_models_moe",
                    "test_models_parallel", "test_trainer_dynamic_sampling", "test_reliability_resume",
                    "test_reliability_numerics"]


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: order.get(item.path.stem, len(order)))  # stable: the rest keep their order
