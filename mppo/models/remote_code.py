"""Whether an HF checkpoint needs its own Python code to load (`actor_rollout_ref.model.trust_remote_code`,
`mppo convert --trust-remote-code`, `mppo sft --trust-remote-code`).

mppo computes with its own models (megatron built from config.json by mppo.models.hf_config, the CPU engine's
packed forward, SGLang's model classes), so no checkpoint code runs in a training step. What can run it is
transformers, at the loads mppo makes through it: the tokenizer (AutoTokenizer), the CPU engine's config and
parameter container (AutoConfig, AutoModelForCausalLM.from_config), SGLang's model config, and `mppo sft`'s
model. trust_remote_code goes to every one of them. transformers needs the checkpoint's code when an `auto_map`
names a class it has no counterpart of: config.json with a model_type it does not know, or tokenizer_config.json
with a tokenizer_class it does not know (without the code it would load a generic tokenizer in its place). With
trust_remote_code=false such a checkpoint stops before anything loads, in one line naming the file and key
(`check_remote_code`); with true, transformers also prefers a checkpoint's code over its own class where an
auto_map names one (HF's rule).

The checkpoint's code files travel with it: mppo's HF exports copy the top-level `*.py` of a source that has an
auto_map (`custom_code_files`), so a converted or saved model loads the same way.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mppo.errors import UserError


class RemoteCodeError(UserError, ValueError):
    """A checkpoint needs its own Python code to load and trust_remote_code is off."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or unreadable: the loader that reads it reports that, with the file name
    return data if isinstance(data, dict) else {}


def _transformers_knows_model_type(model_type: Any) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _transformers_knows_tokenizer(name: Any) -> bool:
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    if not isinstance(name, str):
        return False
    base = name.removesuffix("Fast")
    return tokenizer_class_from_name(base) is not None or tokenizer_class_from_name(base + "Fast") is not None


def remote_code_needs(model_dir: str | Path) -> list[str]:
    """What in `model_dir` transformers can load only by running the checkpoint's code: one phrase per file
    ("<dir>/config.json auto_map (model_type 'x' ...)"); empty when nothing does."""
    import transformers

    where = Path(model_dir).expanduser()
    version = f"transformers {transformers.__version__}"
    needs = []
    config = _read_json(where / "config.json")
    if config.get("auto_map") and not _transformers_knows_model_type(config.get("model_type")):
        needs.append(f"{where / 'config.json'} auto_map names the checkpoint's own code (model_type "
                     f"{config.get('model_type')!r} is not one {version} has)")
    tokenizer = _read_json(where / "tokenizer_config.json")
    auto_map = tokenizer.get("auto_map") or {}
    if isinstance(auto_map, dict) and auto_map.get("AutoTokenizer") and \
            not _transformers_knows_tokenizer(tokenizer.get("tokenizer_class")):
        needs.append(f"{where / 'tokenizer_config.json'} auto_map.AutoTokenizer names the checkpoint's own code "
                     f"(tokenizer_class {tokenizer.get('tokenizer_class')!r} is not one {version} has)")
    return needs


def check_remote_code(model_dir: str | Path, trust_remote_code: bool, *,
                      flag: str = "actor_rollout_ref.model.trust_remote_code=true") -> None:
    """Raise RemoteCodeError (one line) when `model_dir` needs its own code and trust_remote_code is off."""
    if trust_remote_code:
        return
    needs = remote_code_needs(model_dir)
    if needs:
        raise RemoteCodeError(f"{'; '.join(needs)}: it runs only with {flag}; set it for a checkpoint you trust, "
                              "or use one without custom code")


def custom_code_files(source_dir: str | Path) -> list[Path]:
    """The top-level Python files of a checkpoint whose config.json or tokenizer_config.json has an auto_map (an
    auto_map module may import its neighbours, so all of them); empty otherwise."""
    where = Path(source_dir)
    if not any(_read_json(where / name).get("auto_map") for name in ("config.json", "tokenizer_config.json")):
        return []
    return sorted(p for p in where.glob("*.py") if p.is_file())
