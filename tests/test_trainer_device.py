"""The machine checks of mppo.preflight: trainer.device against what the process can see (a mismatch stops the run
with the fix, never a silent switch), and activation recomputation, which needs CUDA."""
from __future__ import annotations

import pytest
import torch

from mppo.config import ConfigError, load_config
from mppo.preflight import check_device, check_recompute


@pytest.mark.parametrize("requested,visible,error", [
    ("cuda", False, "trainer.device=cuda but this process sees no CUDA device"),
    ("cpu", True, "CUDA_VISIBLE_DEVICES= mppo train"),
    ("cpu", False, None), ("cuda", True, None), ("auto", True, None), ("auto", False, None),
])
def test_device_mismatch_is_an_error_naming_the_fix(monkeypatch, requested, visible, error):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    cfg = load_config(None, [f"trainer.device={requested}"])
    if error is None:
        check_device(cfg)
    else:
        with pytest.raises(ConfigError, match=error):
            check_device(cfg)


@pytest.mark.parametrize("device,visible,recompute,error", [
    ("cpu", False, "selective", "actor_rollout_ref.actor.megatron.recompute=selective needs CUDA"),
    ("auto", False, "full", "use actor_rollout_ref.actor.megatron.recompute=none on CPU"),
    ("auto", True, "full", None), ("cuda", True, "selective", None), ("cpu", False, "none", None),
])
def test_recomputation_needs_cuda(monkeypatch, device, visible, recompute, error):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)
    cfg = load_config(None, [f"trainer.device={device}", f"actor_rollout_ref.actor.megatron.recompute={recompute}"])
    if error is None:
        check_recompute(cfg)
    else:
        with pytest.raises(ConfigError, match=error):
            check_recompute(cfg)
