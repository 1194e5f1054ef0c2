"""actor_rollout_ref.model.trust_remote_code (and --trust-remote-code of `mppo convert` / `mppo sft`): a checkpoint
that needs its own code stops in one line while it is off, before any of that code runs; when on, it reaches every
load transformers makes (tokenizer, the CPU engine's config and model class, SGLang's server args, sft's model) and
the code travels with exported checkpoints.

The checkpoints here are a tiny Qwen2 with custom classes in their own files, each of which appends its name to a
marker file of the test when it is imported: what ran is read from there, not from the code under test.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mppo.config import load_config

CONFIG_CODE = '''with open(MARKER_PATH, "a") as f:
    f.write("config\\n")
from transformers import Qwen2Config
class CustomConfig(Qwen2Config):
    pass
'''
MODEL_CODE = '''with open(MARKER_PATH, "a") as f:
    f.write("model\\n")
from transformers import Qwen2ForCausalLM
from .configuration_custom import CustomConfig
class CustomForCausalLM(Qwen2ForCausalLM):
    config_class = CustomConfig
'''
TOKENIZER_CODE = '''with open(MARKER_PATH, "a") as f:
    f.write("tokenizer\\n")
from transformers import PreTrainedTokenizerFast
class CustomTokenizer(PreTrainedTokenizerFast):
    pass
'''


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A tiny Qwen2 with a local tokenizer and no code of its own."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mppo.data import build_local_tokenizer

    root = tmp_path_factory.mktemp("plain")
    tokenizer = build_local_tokenizer(["12 + 34 = 46", "hello world"] * 8, 270, root)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


def _copy(plain: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(plain, dest)
    return dest


@pytest.fixture()
def marker(tmp_path) -> Path:
    """The file the custom code writes to. Its path is in the code, so each test's code differs: transformers
    imports a copy of it keyed by its hash, once per process."""
    return tmp_path / "ran.txt"


def _code(template: str, marker: Path) -> str:
    return template.replace("MARKER_PATH", repr(str(marker)))


def _ran(marker: Path) -> list[str]:
    return marker.read_text().split() if marker.exists() else []


def custom_tokenizer(plain: Path, dest: Path, marker: Path) -> Path:
    """`plain` whose tokenizer is a class transformers does not have (tokenizer_config.json auto_map)."""
    _copy(plain, dest)
    (dest / "tokenization_custom.py").write_text(_code(TOKENIZER_CODE, marker))
    _edit_json(dest / "tokenizer_config.json", tokenizer_class="CustomTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    return dest


def custom_model(plain: Path, dest: Path, marker: Path, model_type: str = "qwen2") -> Path:
    """`plain` whose config.json auto_map names its own config and model classes."""
    _copy(plain, dest)
    (dest / "configuration_custom.py").write_text(_code(CONFIG_CODE, marker))
    (dest / "modeling_custom.py").write_text(_code(MODEL_CODE, marker))
    _edit_json(dest / "config.json", model_type=model_type,
               auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                         "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    return dest


def _cfg(model: Path, *extra: str):
    return load_config(None, [f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=1",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                              "actor_rollout_ref.rollout.name=cpu", *extra], world_size=1)


# ------------------------------------------------------------------------------------------- what needs code
def test_what_needs_the_checkpoints_code(plain, tmp_path, marker):
    from mppo.models.remote_code import remote_code_needs

    assert remote_code_needs(plain) == []
    tok = custom_tokenizer(plain, tmp_path / "tok", marker)
    (need,) = remote_code_needs(tok)
    assert need.startswith(f"{tok}/tokenizer_config.json auto_map.AutoTokenizer names the checkpoint's own code "
                           "(tokenizer_class 'CustomTokenizer' is not one transformers ")
    # a model_type transformers has: its own class serves without the checkpoint's code
    assert remote_code_needs(custom_model(plain, tmp_path / "known", marker)) == []
    unknown = custom_model(plain, tmp_path / "unknown", marker, model_type="my_llm")
    (need,) = remote_code_needs(unknown)
    assert "config.json auto_map names the checkpoint's own code (model_type 'my_llm' is not one" in need


def test_the_trainer_checks_stop_in_one_line_without_it(plain, tmp_path, marker):
    """The start-up checks (`mppo train` with or without --dry-run): the file, the key and the fix."""
    from mppo.models.hf_config import UnsupportedModelError
    from mppo.models.remote_code import RemoteCodeError
    from mppo.preflight import check_models

    tok = custom_tokenizer(plain, tmp_path / "tok", marker)
    with pytest.raises(RemoteCodeError) as info:
        check_models(_cfg(plain, f"actor_rollout_ref.model.tokenizer_path={tok}"))
    message = str(info.value)
    assert "\n" not in message and f"{tok}/tokenizer_config.json auto_map.AutoTokenizer" in message
    assert message.endswith("it runs only with actor_rollout_ref.model.trust_remote_code=true; set it for a "
                            "checkpoint you trust, or use one without custom code")
    check_models(_cfg(plain, f"actor_rollout_ref.model.tokenizer_path={tok}",
                      "actor_rollout_ref.model.trust_remote_code=true"))
    # an architecture mppo does not build is refused whatever the setting: its code would not be run
    unknown = custom_model(plain, tmp_path / "unknown", marker, model_type="my_llm")
    for trust in ("false", "true"):
        with pytest.raises(UnsupportedModelError, match=r"model_type 'my_llm' is not supported \(its auto_map code "
                                                        r"is not run: mppo builds its own models\)"):
            check_models(_cfg(unknown, f"actor_rollout_ref.model.trust_remote_code={trust}"))
    assert _ran(marker) == []  # the checks only read the json files


# ------------------------------------------------------------------------------------------------ the loads
def test_tokenizer_runs_its_code_only_when_trusted(plain, tmp_path, marker):
    from mppo.data import load_tokenizer
    from mppo.models.remote_code import RemoteCodeError

    tok = custom_tokenizer(plain, tmp_path / "tok", marker)
    with pytest.raises(RemoteCodeError, match="actor_rollout_ref.model.trust_remote_code=true"):
        load_tokenizer(tok)
    assert _ran(marker) == []
    tokenizer = load_tokenizer(tok, trust_remote_code=True)
    assert type(tokenizer).__name__ == "CustomTokenizer" and _ran(marker) == ["tokenizer"]
    assert tokenizer("12 + 34")["input_ids"] == load_tokenizer(plain)("12 + 34")["input_ids"]


def test_cpu_engine_gets_the_checkpoints_classes_only_when_trusted(plain, tmp_path, marker):
    from mppo.rollout.factory import _cpu_engine

    model = custom_model(plain, tmp_path / "custom", marker)
    engine = _cpu_engine(SimpleNamespace(cfg=_cfg(model)))
    assert type(engine._config).__name__ == "Qwen2Config" and type(engine._model).__name__ == "Qwen2ForCausalLM"
    assert _ran(marker) == []
    engine = _cpu_engine(SimpleNamespace(cfg=_cfg(model, "actor_rollout_ref.model.trust_remote_code=true")))
    assert type(engine._config).__name__ == "CustomConfig"
    assert type(engine._model).__name__ == "CustomForCausalLM" and set(_ran(marker)) == {"config", "model"}


@pytest.mark.parametrize("trust", [False, True])
def test_sglang_engine_gets_the_setting(plain, monkeypatch, tmp_path, trust):
    from test_rollout_sglang import InProcessIPC, fake_api

    import mppo.rollout.sglang_engine as sglang_engine
    from mppo.rollout.factory import _sglang_engine

    api, engines = fake_api(InProcessIPC())
    monkeypatch.setattr(sglang_engine, "load_sglang_api", lambda on_cpu: api)
    cfg = _cfg(plain, "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.model.trust_remote_code={trust}")
    spec = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(ranks=[0], group_index=0, base_gpu_id=0), tp_group=None,
                           device=torch.device("cuda"), dtype=torch.bfloat16, log_dir=tmp_path)
    _sglang_engine(spec)
    (engine,) = engines
    assert engine.server_args["trust_remote_code"] is trust


def test_sft_loads_a_model_with_its_code_only_when_asked(plain, tmp_path, marker, capsys):
    from mppo import sft

    model = custom_model(plain, tmp_path / "custom", marker, model_type="my_llm")
    data = tmp_path / "none.parquet"  # the model is refused before the data is read
    status = sft.main(["--data", str(data), "--out", str(tmp_path / "out"), "--model", str(model),
                       "--tokenizer", str(plain)])
    error = capsys.readouterr().err.strip()
    assert status == 2 and error.startswith("mppo sft: error: ") and "\n" not in error
    assert error.endswith("it runs only with --trust-remote-code; set it for a checkpoint you trust, or use one "
                          "without custom code") and _ran(marker) == []
    # my_llm is mppo's business only in training; sft runs transformers' model, the checkpoint's own class here
    loaded = sft.load_model(model, trust_remote_code=True)
    assert type(loaded).__name__ == "CustomForCausalLM" and set(_ran(marker)) == {"config", "model"}


# ------------------------------------------------------------------------------------------ exported checkpoints
def test_convert_refuses_without_the_flag_and_exports_carry_the_code(plain, tmp_path, marker, capsys):
    from mppo.models import convert
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import write_hf_metadata

    tok = custom_tokenizer(plain, tmp_path / "tok", marker)
    assert convert.main(["hf-to-mcore", "--hf", str(tok), "--out", str(tmp_path / "mcore")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("mppo convert: error: ") and "\n" not in error and "--trust-remote-code" in error
    assert not (tmp_path / "mcore").exists()
    out = tmp_path / "exported"
    write_hf_metadata(out, read_hf_config(tok), tokenizer_dir=tok)  # what every HF export (convert, save) writes
    assert (out / "tokenization_custom.py").read_text() == (tok / "tokenization_custom.py").read_text()
    write_hf_metadata(tmp_path / "plain_export", read_hf_config(plain), tokenizer_dir=plain)
    assert not list((tmp_path / "plain_export").glob("*.py"))
    assert _ran(marker) == []
