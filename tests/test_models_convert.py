"""`mppo convert` as a lone process (no torchrun): HF -> dist checkpoint -> HF, dtype change, layout error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "dist"))


def _convert(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mppo.models.convert", *argv], env=env, capture_output=True,
                          text=True, timeout=300)


def test_convert_roundtrip_in_one_process(tmp_path):
    from models_fixtures import make_hf_model, save_tiny_tokenizer
    from safetensors.torch import load_file

    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    make_hf_model("qwen2_tied", hf_dir)
    save_tiny_tokenizer(hf_dir, 1000)

    proc = _convert("hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (ckpt / "model" / "metadata.json").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".*.tmp")), "temporary directory left behind"

    # fp32 checkpoint -> bf16 model -> bf16 HF tensors: the same values as casting the original
    proc = _convert("mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    original, exported = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(exported) == sorted(k for k in original if k != "lm_head.weight")  # tied: no lm_head
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, original[name].to(torch.bfloat16)), name
    assert (back / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    config, source = (json.loads((d / "config.json").read_text()) for d in (back, hf_dir))
    assert config == {**source, "dtype": "bfloat16"}  # the exported dtype, else unchanged

    proc = _convert("hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "x"), "--tp", "2")
    assert proc.returncode == 2 and "world size 1 is not divisible by tp*pp = 2*1" in proc.stderr
    assert "torchrun" in proc.stderr and not (tmp_path / "x").exists()


def test_mcore_to_hf_names_the_actor_of_a_step_directory(tmp_path, capsys):
    """A training run's step directory holds one worker checkpoint per model: mcore-to-hf says which to give."""
    from mppo.models import convert

    step = tmp_path / "checkpoints" / "global_step_3"
    (step / "actor" / "hf").mkdir(parents=True)
    (step / "actor" / "hf" / "config.json").write_text("{}")
    assert convert.main(["mcore-to-hf", "--ckpt", str(step), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{step} is a training run's step directory" in err and f"--ckpt {step / 'actor'}" in err
    assert not (tmp_path / "out").exists()
    assert convert.main(["mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "is not an mppo model checkpoint" in capsys.readouterr().err
