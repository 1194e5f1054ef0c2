"""mppo.parallel in a lone process without torchrun: world size 1, gloo, the CPU patches, layout errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_single_process_world_of_one():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, str(REPO / "tests/dist/models_single_process.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "world size 1 is not divisible by tp*pp = 2*1" in res["tp2_error"]
    assert res["initialized_after_error"] is False and res["installed_before"] == []
    assert res["dims"] == [1, 0, 1, 1, 1, "gloo", "cpu"]
    from mppo.parallel.cpu_compat import PATCHES

    assert res["installed"] == [p.name for p in PATCHES]
    assert "destroy() first" in res["twice_error"]
    assert res["logits_shape"] == [1, 5, 384]  # 300 tokens padded to a multiple of 128
    assert res["fork_repeatable"] is True
    assert res["ref_frozen"] is True and "role must be one of" in res["bad_role_error"]
    assert res["initialized_after_destroy"] is False
