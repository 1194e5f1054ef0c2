"""Security: no eval/exec of anything (model output least of all), nothing unpickled unless weights-only or vetted,
custom reward code only from the configured file. Source scans use the AST, so comments and strings never count."""
from __future__ import annotations

import ast
import builtins
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_util import REPO

from mppo.rewards import countdown
from mppo.rewards.registry import RewardConfigError, default_compute_score, load_custom_reward_fn
from mppo.trainer.checkpoint import CheckpointError, CheckpointManager

SOURCES = sorted([*(REPO / "mppo").rglob("*.py"), *(REPO / "kernels").rglob("*.py")])


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            yield node


def _dotted(func: ast.expr) -> str:
    """'torch.load' for torch.load(...), 'eval' for eval(...), '' for calls on computed objects."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        return ".".join([func.id, *reversed(parts)])
    return ""


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else kw.value
    return None


def test_package_sources_are_found():
    assert len(SOURCES) > 50 and REPO / "mppo" / "rewards" / "arith.py" in SOURCES


def test_no_eval_exec_or_compile_in_the_package():
    forbidden = {"eval", "exec", "compile", "__import__", "builtins.eval", "builtins.exec"}
    hits = [f"{p.relative_to(REPO)}:{c.lineno} {_dotted(c.func)}" for p in SOURCES for c in _calls(p)
            if _dotted(c.func) in forbidden]
    assert hits == []


def test_every_unpickling_is_weights_only():
    """torch.load only with weights_only=True; no pickle/dill/joblib loads, no numpy allow_pickle."""
    problems = []
    for path in SOURCES:
        for call in _calls(path):
            name, where = _dotted(call.func), f"{path.relative_to(REPO)}:{call.lineno}"
            if name.endswith("torch.load") or name == "torch.serialization.load":
                if _keyword(call, "weights_only") is not True:
                    problems.append(f"{where} {name} without weights_only=True")
            elif name.split(".")[0] in ("pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve") and \
                    name.rsplit(".", 1)[-1] in ("load", "loads", "Unpickler", "open"):
                problems.append(f"{where} {name}")
            elif name.endswith(("np.load", "numpy.load")) and _keyword(call, "allow_pickle") is not None:
                problems.append(f"{where} {name} with allow_pickle")
            elif _keyword(call, "trust_remote_code") is True:
                problems.append(f"{where} {name} with trust_remote_code=True")
    assert problems == []


# ------------------------------------------------------------------------------------------- checkpoint vetting
class _Payload:
    """Unpickling this runs a shell command: the classic malicious pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(root, resume_config={"k": 1}, layout={"tp": 1})


def _save_dcp(manager: CheckpointManager, step: int, extra) -> Path:
    """A checkpoint whose 'actor/model' is a torch.distributed.checkpoint directory, as megatron writes them."""
    def write(path: Path) -> None:
        dcp.save({"weight": torch.arange(4.0), "extra_state": extra}, checkpoint_id=path / "model", no_dist=True)
    return manager.save(step, {"actor": write}, {"step": step})


def test_checkpoint_pickles_are_vetted_before_anything_unpickles_them(tmp_path):
    manager, marker = _manager(tmp_path), tmp_path / "pwned"
    good = _save_dcp(manager, 1, {"fp8_meta": None, "scale": torch.ones(2)})  # plain data: accepted
    assert manager.verify(good)["step"] == 1

    # A byte entry (torch.distributed.checkpoint would torch.load it with weights_only=False) holding code.
    bad_entry = _save_dcp(manager, 2, _Payload(marker))
    with pytest.raises(CheckpointError, match=r"actor/model/\.metadata: refused to unpickle"):
        manager.verify(bad_entry)

    # The .metadata pickle itself (read with plain pickle.load by torch.distributed.checkpoint) replaced by code;
    # the manifest is rewritten to match, as an attacker would.
    bad_meta = _save_dcp(manager, 3, {"fp8_meta": None})
    import pickle

    (bad_meta / "actor" / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rewrite_manifest(bad_meta)
    with pytest.raises(CheckpointError, match=r"refused to unpickle \(UnpicklingError: it references posix.system"):
        manager.verify(bad_meta)

    # A *.pt file (megatron's common.pt) holding code.
    bad_pt = _save_dcp(manager, 4, {"fp8_meta": None})
    torch.save({"common": _Payload(marker)}, bad_pt / "actor" / "model" / "common.pt")
    _rewrite_manifest(bad_pt)
    with pytest.raises(CheckpointError, match=r"common\.pt: refused to unpickle"):
        manager.verify(bad_pt)

    assert not marker.exists()  # nothing ran
    assert manager.latest().step == 1  # and the run would resume from the good one, reporting the others


def _rewrite_manifest(step_dir: Path) -> None:
    from mppo.trainer.checkpoint import MANIFEST, _inventory

    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] = _inventory(step_dir)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


# ------------------------------------------------------------------------------------------- rewards
PROMPT = "User: Using the numbers [3, 5, 7], make 22.\nAssistant: Let me solve this step by step.\n<think> </think>\n"


def test_arithmetic_scorer_needs_no_eval(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("eval/exec/compile called")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, refuse)
    truth = {"target": 22, "numbers": [3, 5, 7]}
    assert countdown.compute_score(PROMPT + "<answer> (3 * 5) + 7 </answer>", truth) == 1.0
    assert countdown.compute_score(PROMPT + "<answer> 5 * 3 + 7 / 1 </answer>", truth) == 0.1
    hostile = f"<answer> __import__('os').system('touch {tmp_path / 'x'}') </answer>"
    assert countdown.compute_score(PROMPT + hostile, truth) == 0.1
    assert not (tmp_path / "x").exists()


def test_reward_code_comes_only_from_the_configured_file(tmp_path, monkeypatch):
    # A module of the same name earlier on sys.path is not what gets loaded: the configured file is.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "my_reward.py").write_text("def score(**kw):\n    return -1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    (tmp_path / "my_reward.py").write_text("def score(**kw):\n    return 1.0\n")
    assert load_custom_reward_fn(tmp_path / "my_reward.py", "score")() == 1.0
    # Data never selects code: an unknown data_source is an error, not a module to import.
    with pytest.raises(RewardConfigError, match="no built-in reward for data_source 'os.system'"):
        default_compute_score("os.system", "rm -rf /", "x")
