"""LR schedule (megatron's OptimizerParamScheduler as mppo configures it) against the formulas written out, and
the worker set-up checks that need no process group."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mppo.config.schema import ModelConfig, OptimConfig


class _Groups:
    """Stands in for a megatron optimizer: the scheduler only writes lr / weight_decay into param_groups."""

    def __init__(self):
        self.param_groups = [{"lr": None, "weight_decay": None}]


def _lrs(optim: OptimConfig, total: int) -> list[float]:
    from mppo.workers.optim import build_lr_scheduler

    opt = _Groups()
    sched = build_lr_scheduler(opt, optim, total)
    out = []
    for _ in range(total + 2):
        out.append(opt.param_groups[0]["lr"])
        sched.step(1)
    return out


def test_constant_with_warmup():
    lrs = _lrs(OptimConfig(lr=1e-3, lr_warmup_steps=4, lr_scheduler="constant"), total=10)
    assert lrs[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[5:] == pytest.approx([1e-3] * 7)


def test_cosine_decays_to_min_lr_ratio_with_warmup_ratio():
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.2, lr_scheduler="cosine",
                        min_lr_ratio=0.1)
    total, warm, lo = 10, 2, 1e-4
    expected = []
    for s in range(total + 2):
        if s <= warm:
            expected.append(1e-3 * s / warm)
        elif s > total:
            expected.append(lo)
        else:
            expected.append(lo + 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))) * (1e-3 - lo))
    assert _lrs(optim, total) == pytest.approx(expected)


def test_no_warmup_starts_at_full_lr():
    assert _lrs(OptimConfig(lr=2e-6), total=3)[0] == pytest.approx(2e-6)


def test_scheduler_state_round_trip():
    from mppo.workers.optim import build_lr_scheduler

    optim = OptimConfig(lr=1e-3, lr_warmup_steps=3, lr_scheduler="cosine")
    a, b = _Groups(), _Groups()
    first = build_lr_scheduler(a, optim, 8)
    first.step(1)
    first.step(1)
    second = build_lr_scheduler(b, optim, 8)
    second.load_state_dict(first.state_dict())
    assert second.num_steps == 2 and b.param_groups[0]["lr"] == pytest.approx(a.param_groups[0]["lr"])


@pytest.mark.parametrize("optim, total, message", [
    (OptimConfig(lr_scheduler="cosine", lr_warmup_steps=5), 5, "no room for a cosine decay"),
    (OptimConfig(), 0, "total_steps must be >= 1"),
])
def test_scheduler_errors(optim, total, message):
    from mppo.workers.optim import build_lr_scheduler

    with pytest.raises(ValueError, match=message):
        build_lr_scheduler(_Groups(), optim, total)


def _dims(**kw):
    base = dict(tp=2, pp=1, vpp=None, dp=2, ep=1, expert_tp=2, cp=1, device=torch.device("cpu"))
    return SimpleNamespace(**{**base, **kw})


def test_dtype_and_recompute_choices():
    from mppo.workers.base import recompute_overrides, resolve_dtype

    assert resolve_dtype(ModelConfig(dtype="auto"), _dims()) == torch.float32
    assert resolve_dtype(ModelConfig(dtype="auto"), _dims(device=torch.device("cuda", 0))) == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="bf16"), _dims()) == torch.bfloat16
    assert recompute_overrides("none") == {}
    assert recompute_overrides("selective") == {"recompute_granularity": "selective"}
    assert recompute_overrides("full")["recompute_granularity"] == "full"
