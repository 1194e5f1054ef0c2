"""Security: no eval/exec of anything (model output least of all), nothing unpickled unless weights-only or vetted,
custom reward code only from the configured file. Source scans use the AST, so comments and strings never count."""
from __future__ import annotations

import ast
import builtins
import hashlib
import json
import os
import pickle
import re
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


def _rewrite_manifest(step_dir: Path) -> None:
    """What an attacker who can write the directory does: list every file (through symlinks) with its checksum."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"] = {str(f.relative_to(step_dir)): {"size": f.stat().st_size,
                                                        "blake2b": hashlib.blake2b(f.read_bytes(), digest_size=16)
                                                        .hexdigest()}
                         for f in step_dir.rglob("*") if f.is_file() and f.name != "manifest.json"}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _unlist(step_dir: Path, rel: str) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    del manifest["files"][rel]
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _hostile(step: Path, case: str, marker: Path) -> str:
    """Put code where a reader would unpickle it (or, `unlisted_file`, just an extra file); return the regex the
    refusal must match: the file's path and why."""
    model, code = step / "actor" / "model", pickle.dumps(_Payload(marker))
    at_model, at_step = re.escape(str(model)), re.escape(str(step))
    if case == "unlisted_metadata":  # the reported attack: .metadata dropped from the manifest, then replaced
        _unlist(step, "actor/model/.metadata")
        (model / ".metadata").write_bytes(code)
        return rf"{at_model}/\.metadata: not listed in the manifest"
    if case == "unlisted_file":
        (model / "notes.txt").write_text("harmless, but nobody vouched for it")
        return rf"{at_model}/notes\.txt: not listed in the manifest"
    if case == "symlinked_metadata":  # hashed through the link; a loader could be shown another file
        (step.parent / "elsewhere").write_bytes(code)
        (model / ".metadata").unlink()
        (model / ".metadata").symlink_to(step.parent / "elsewhere")
        _rewrite_manifest(step)
        return rf"{at_model}/\.metadata: not a regular file"
    if case == "listed_metadata":
        (model / ".metadata").write_bytes(code)
    elif case == "rank_metadata":  # torch falls back to __<rank>.metadata when .metadata does not load
        (model / ".metadata").unlink()
        (model / "__0.metadata").write_bytes(code)
    elif case == "common_pt":  # megatron's common state
        torch.save({"common": _Payload(marker)}, model / "common.pt")
    elif case == "trainer_state_pt":
        torch.save({"rng": _Payload(marker)}, step / "trainer_state.pt")
    elif case == "unnamed_pickle":  # no .pt suffix: a loader that torch.loads it is caught by its first bytes
        torch.save({"rng": _Payload(marker)}, step / "actor" / "rng_state")
    _rewrite_manifest(step)
    return {"listed_metadata": rf"{at_model}/\.metadata: refused to unpickle \(UnpicklingError: it references posix",
            "rank_metadata": rf"{at_model}/__0\.metadata: refused to unpickle \(UnpicklingError",
            "common_pt": rf"{at_model}/common\.pt: refused to unpickle",
            "trainer_state_pt": rf"{at_step}/trainer_state\.pt: refused to unpickle",
            "unnamed_pickle": rf"{at_step}/actor/rng_state: refused to unpickle"}[case]


def _resume_reads(manager: CheckpointManager) -> int:
    """What a resume does: take the step latest() picks, then read its model with torch.distributed.checkpoint's
    loader (megatron's dist_checkpointing calls the same reader). Returns the step."""
    info = manager.latest()
    state = {"weight": torch.zeros(4), "extra_state": {"fp8_meta": "unread", "scale": torch.zeros(2)}}
    dcp.load(state, checkpoint_id=info.path / "actor" / "model", no_dist=True)
    assert torch.equal(state["weight"], torch.arange(4.0)) and state["extra_state"]["fp8_meta"] is None
    return info.step


@pytest.mark.parametrize("case", ["unlisted_metadata", "unlisted_file", "symlinked_metadata", "listed_metadata",
                                  "rank_metadata", "byte_entry", "common_pt", "trainer_state_pt", "unnamed_pickle"])
def test_a_hostile_checkpoint_is_refused_naming_the_file_and_resume_falls_back(tmp_path, caplog, case):
    manager, marker = _manager(tmp_path), tmp_path / "pwned"
    good = _save_dcp(manager, 1, {"fp8_meta": None, "scale": torch.ones(2)})  # plain data: accepted
    assert manager.verify(good)["step"] == 1
    if case == "byte_entry":  # torch.distributed.checkpoint would torch.load it with weights_only=False
        step = _save_dcp(manager, 2, _Payload(marker))
        refusal = (rf"{re.escape(str(step))}/actor/model/__0_0\.distcp: entry extra_state \(named in .*\.metadata\): "
                   "refused to unpickle")
    else:
        step = _save_dcp(manager, 2, {"fp8_meta": None})
        refusal = _hostile(step, case, marker)
    with pytest.raises(CheckpointError, match=refusal):
        manager.verify(step)
    with caplog.at_level("WARNING", logger="mppo"):
        assert _resume_reads(manager) == 1  # the run resumes from the older good step...
    assert re.search("skipping checkpoint " + refusal, caplog.text)  # ...saying which file it refused
    assert not marker.exists()  # and nothing ran


def test_model_loaders_and_convert_vet_before_loading(tmp_path, capsys):
    """`mppo convert mcore-to-hf`, load_model_checkpoint and load_worker_checkpoint stop with one line naming the
    file, before megatron's loader (or the model build) starts."""
    from mppo.errors import UserError
    from mppo.models import convert
    from mppo.models.checkpoint import load_model_checkpoint
    from mppo.workers.worker_checkpoint import load_worker_checkpoint

    marker, ckpt = tmp_path / "pwned", tmp_path / "ckpt"
    dcp.save({"weight": torch.arange(4.0), "extra_state": _Payload(marker)}, checkpoint_id=ckpt / "model",
             no_dist=True)
    (ckpt / "model" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))  # as megatron
    torch.save({"common": torch.ones(1)}, ckpt / "model" / "common.pt")  # writes them; both pass the vetting
    (ckpt / "hf").mkdir()
    (ckpt / "hf" / "config.json").write_text("{}")
    at = re.escape(str(ckpt))
    entry = rf"{at}/model/__0_0\.distcp: entry extra_state \(named in {at}/model/\.metadata\): refused to unpickle"
    for load in (load_model_checkpoint, load_worker_checkpoint):
        with pytest.raises(UserError, match=entry):  # a mistake the user can fix: one line, exit 2
            load([], ckpt)

    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    assert convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(rf"mppo convert: error: {at}/model/\.metadata: refused to unpickle "
                                             r"\(UnpicklingError: it references posix\.system", err), err
    assert not marker.exists() and not (tmp_path / "out").exists()


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
