"""StepMetrics: per-micro-batch metric contributions stay on the device (no host read per micro-batch) and sum,
in float64, to exactly what the host's Python-float arithmetic gives (the workers' metrics before they moved to
the device); the step's one host read is in `reduce`."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from mppo.workers.base import StepMetrics, as_float64, share_of

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from workers_fixtures import count_host_reads  # noqa: E402


def _micro_batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = torch.randn((), generator=g)  # fp32, like a micro-batch loss
        clipfrac = torch.rand((), generator=g)
        mask = (torch.rand(3, 5, generator=g) > 0.3).float()
        yield loss, clipfrac, mask


def test_contributions_sum_on_device_to_the_host_floats_bitwise():
    dp, tokens = 3, 37
    metrics = StepMetrics(("loss", "clipfrac", "python"))
    reads: dict[str, int] = {}
    with count_host_reads(reads):
        for loss, clipfrac, mask in _micro_batches(6):
            share = share_of(mask.sum(), tokens)
            metrics.add("loss", share_of(loss, dp))
            metrics.add("clipfrac", as_float64(clipfrac) * share)
            metrics.add("python", 0.25 * share)  # a Python float from core_algos, weighted on the device
            metrics.check_finite(loss)
    assert reads == {}, f"host reads while accumulating: {reads}"
    # the reference: the host arithmetic the workers used before (.item() / float() per micro-batch)
    expected = {"loss": 0.0, "clipfrac": 0.0, "python": 0.0}
    for loss, clipfrac, mask in _micro_batches(6):
        share = float(mask.sum()) / tokens
        expected["loss"] += loss.item() / dp
        expected["clipfrac"] += float(clipfrac) * share
        expected["python"] += 0.25 * share
    values, nonfinite = metrics.reduce(contributes=True, device=torch.device("cpu"))
    assert values == expected  # bitwise: == on floats
    assert nonfinite is False


def test_non_finite_loss_and_missing_keys():
    metrics = StepMetrics(("a", "b"))
    metrics.add("a", share_of(torch.tensor(1.0), 2))
    metrics.check_finite(torch.tensor(float("nan")))
    values, nonfinite = metrics.reduce(contributes=True, device=torch.device("cpu"))
    assert values == {"a": 0.5} and nonfinite is True  # "b" was never reported
    quiet = StepMetrics(("a",))
    quiet.add("a", 1.0)
    quiet.check_finite(torch.tensor(float("inf")))
    # a rank that does not contribute (not the last stage's first TP rank) reports nothing
    assert quiet.reduce(contributes=False, device=torch.device("cpu")) == ({}, False)
