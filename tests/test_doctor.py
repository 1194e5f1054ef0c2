"""`mppo doctor`: its report on this machine matches what the environment really has (checked independently:
importlib.metadata, find_spec, torch itself), the config decides the exit code, and fake packages that are too
old, fail to import, hang or kill the interpreter get the right verdicts without taking the report down."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mppo import doctor

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report_json() -> dict:
    """One real `python -m mppo doctor --json` run (the imports take a few seconds each, in parallel)."""
    proc = subprocess.run([sys.executable, "-m", "mppo", "doctor", "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_report_is_truthful(report_json):
    import torch

    checks = {c["name"]: c for c in report_json["packages"]}
    for name, dist in (("torch", "torch"), ("megatron-core", "megatron-core"), ("transformers", "transformers")):
        assert checks[name]["status"] == "works", checks[name]
        assert checks[name]["version"] == importlib.metadata.version(dist)
    for name, module in (("Transformer Engine", "transformer_engine"), ("SGLang", "sglang"), ("Triton", "triton")):
        if importlib.util.find_spec(module) is None:
            assert checks[name]["status"] == "missing package" and checks[name]["hint"] == "pip install mppo[gpu]"
        else:
            assert checks[name]["version"] is not None
    facts = checks["torch"]["facts"]
    assert facts["cuda_available"] == torch.cuda.is_available()
    assert facts["cuda_build"] == torch.version.cuda
    assert len(report_json["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report_json["ok"] and report_json["problems"] == []

    text = doctor.render_text(doctor.Report.from_dict(report_json))
    selftests = {t["name"]: t for t in report_json["selftests"]}
    if not torch.cuda.is_available():
        assert "no GPU: GPU self-tests skipped" in text
        assert all(t["status"] == "no GPU" for name, t in selftests.items() if name not in doctor.RUNS_WITHOUT_GPU)
    if importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine   -                missing package: not installed (supported >=2.0)" in text
    if torch.version.cuda is None:
        nccl = next(ln for ln in text.splitlines() if ln.split()[:2] == ["NCCL", "-"])
        assert "not available" in nccl and "CPU-only build of torch" in text
    assert "verdict: OK" in text
    features = {f["name"]: f for f in report_json["features"]}
    assert features["CPU training, demo and tests (gloo)"]["status"] == "works"
    if importlib.util.find_spec("sglang") is None:
        assert features["SGLang rollout"]["status"] == "unavailable"
        assert "rollout.name=cpu" in features["SGLang rollout"]["detail"]
    else:  # a real engine round trip ran (SGLang's CPU tier without a GPU): only then does it say "works"
        trip = selftests["SGLang round trip"]
        assert trip["status"] == "works", trip
        assert "weights pushed and read back bitwise (twice)" in trip["detail"], trip
        assert features["SGLang rollout"]["status"] == "works" and "self-test works" in features["SGLang rollout"][
            "detail"]


def test_the_config_decides_the_exit_code(report_json, monkeypatch, capsys):
    """A GPU recipe needs CUDA, SGLang and Triton: on a machine without them doctor says so and exits 1;
    the CPU demo needs none of it and exits 0 on the same report."""
    import torch

    monkeypatch.setattr(doctor, "collect", lambda timeout: doctor.Report.from_dict(report_json))
    gpu_recipe = str(REPO / "configs/countdown_qwen2.5_3b_ppo.yaml")
    code = doctor.main([gpu_recipe])
    text = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert code == 1 and "verdict: BROKEN for this run:" in text
        assert "trainer.device=cuda with 2 GPUs per node, but 0 GPU(s) are visible" in text
        if importlib.util.find_spec("sglang") is None:
            assert "SGLang (actor_rollout_ref.rollout.name=sglang): missing package" in text
    monkeypatch.setenv("RUN_DIR", "/nonexistent")  # demo_cpu.yaml interpolates it; doctor reads no files
    assert doctor.main([str(REPO / "configs/demo_cpu.yaml")]) == 0
    assert "verdict: OK for " + str(REPO / "configs/demo_cpu.yaml") in capsys.readouterr().out
    needs = doctor.config_needs(__import__("mppo.config", fromlist=["load_config"]).load_config(
        gpu_recipe, ["actor_rollout_ref.model.transformer_impl=te"]))
    assert needs["Transformer Engine"] == "actor_rollout_ref.model.transformer_impl=te"


def _fake(root: Path, name: str, body: str, version: str | None = None) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    (pkg / "pytorch.py").write_text("")
    if version:
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_fake_packages_get_the_right_verdict(tmp_path, monkeypatch, report_json):
    _fake(tmp_path / "old", "sglang", "__version__ = '0.4.9'\n", "0.4.9")
    _fake(tmp_path / "good", "sglang", "__version__ = '0.5.30'\n", "0.5.30")
    _fake(tmp_path / "old", "transformer_engine",
          "raise OSError('libcudnn.so.9: cannot open shared object file: No such file or directory')\n", "2.20.0")
    _fake(tmp_path / "old", "hangpkg", "import time\ntime.sleep(60)\n")
    _fake(tmp_path / "old", "crashpkg", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    _fake(tmp_path / "old", "torch", "raise ImportError('libtorch_cuda.so: undefined symbol: ncclCommSplit')\n",
          "2.7.0+cu126")
    path = os.environ.get("PYTHONPATH", "")

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "old"), str(REPO), path]))
    sglang, te = (next(p for p in doctor.PACKAGES if p.name == n) for n in ("SGLang", "Transformer Engine"))
    old = doctor.probe_package(sglang)
    assert (old.status, old.version, old.hint) == ("wrong version", "0.4.9", "pip install mppo[gpu]")
    assert ">=0.5.23,<0.6" in old.detail
    broken = doctor.probe_package(te)
    assert broken.status == "import fails" and "libcudnn.so.9" in broken.detail and broken.version == "2.20.0"
    hang = doctor.probe_package(doctor.Package("hangpkg", "hangpkg", ("hangpkg",), None, "fix it"), timeout=3)
    assert hang.status == "import fails" and "timed out after 3 s" in hang.detail
    crash = doctor.probe_package(doctor.Package("crashpkg", "crashpkg", ("crashpkg",), None, "fix it"))
    assert crash.status == "import fails" and "killed by signal 11" in crash.detail

    torch = doctor.probe_package(doctor.PACKAGES[0])
    assert torch.status == "import fails" and "undefined symbol: ncclCommSplit" in torch.detail
    report = doctor.Report.from_dict(report_json)
    report.packages[0] = torch
    text = doctor.render_text(doctor.judge(report, {name: "mppo itself" for name in doctor.CORE}))
    assert "unknown: torch does not import" in text and "verdict: BROKEN" in text
    assert "torch (mppo itself): import fails" in text

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "good"), str(REPO), path]))
    good = doctor.probe_package(sglang)
    assert (good.status, good.version) == ("works", "0.5.30")


def test_gpu_selftests_run_on_cpu_stand_ins(capsys):
    """No GPU here: the self-tests' code runs on CPU instead (Triton under its interpreter, which conftest turns
    on; the all-reduce worker over gloo as a world of one), so a broken API call in them cannot hide until a
    user's GPU node. (The multi-process spawn around the worker was run by hand with 2 gloo ranks.)"""
    doctor._selftest_triton(device="cpu", rows=32, vocab=512)
    doctor._allreduce_worker(0, 1, _free_port(), "gloo", 1 << 16)
    triton, allreduce = (json.loads(ln[len(doctor.MARK):]) for ln in capsys.readouterr().out.splitlines()
                         if ln.startswith(doctor.MARK))
    assert triton["ok"] and "max |triton - torch|" in triton["detail"]
    assert allreduce["ok"] and allreduce["detail"].startswith("1 cpu rank(s), sum correct: True")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_megatron_core_is_pinned_to_the_release_its_patches_were_proven_on(report_json, monkeypatch):
    """setup.py requires the range of mppo/versions.py, which holds the release the CPU patches were probed on
    (tests/test_models_parallel.py checks the installed one is it), and the doctor's verdict line says so."""
    import runpy

    import setuptools
    from packaging.requirements import Requirement

    from mppo.versions import MEGATRON_CORE_PROVEN_ON, MEGATRON_CORE_SUPPORTED

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))  # what pip would be given
    runpy.run_path(str(REPO / "setup.py"))
    requires = {Requirement(r).name: Requirement(r).specifier for r in seen["install_requires"]}
    assert str(requires["megatron-core"]) == str(Requirement(f"megatron-core{MEGATRON_CORE_SUPPORTED}").specifier)
    assert requires["megatron-core"].contains(MEGATRON_CORE_PROVEN_ON)
    assert not requires["megatron-core"].contains("0.17.0")  # the untested releases are refused
    megatron = next(c for c in report_json["packages"] if c["name"] == "megatron-core")
    assert f"CPU patches proven on {MEGATRON_CORE_PROVEN_ON}" in megatron["detail"], megatron
