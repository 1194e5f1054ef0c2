"""The environment checks of a run: what its config asks of this machine and of the files it names.

A run is checked in two places before anything is built, and `mppo train` (with or without --dry-run), `mppo plan`
and the trainer run both:
- `mppo.config.validate` (load_config calls it): the config on its own. Choices, ranges, the parallel layout
  against the world size, batch arithmetic, and what the models' config.json states. Pure: no torch, nothing of
  this machine.
- `check_run` here, in this order:
  1. the machine: the rollout engine's package, Transformer Engine, the device (and activation recomputation,
     which needs CUDA), an engine's ranks within one node of this launch (torchrun's LOCAL_WORLD_SIZE);
  2. the model directories, where they are at hand: a model mppo can map, no checkpoint code unless trusted, a
     model the rollout engine serves right, LoRA it can adapt;
  3. the run's own inputs, which planning does not need: the model directories exist, data.train_files is set.
  With `planning` (`--dry-run`, `mppo plan`: planning a GPU run from a login node or a laptop) the run is for
  another machine: a missing rollout package is a warning, the device and (3) are not checked.
What can only be checked on a loaded object is checked here too, by the code that loads it, right after: the
tokenizer (`check_tokenizer`: its ids fit the model's vocabulary, the chat template multi-turn needs) and the
training data (`check_train_data`: a reward function for each data source). A data file's own content (a missing
field, an unreadable file) is the data loader's to report (mppo.data.DatasetError), as it reads the rows.

Builders and workers trust these checks and repeat none of them; tests/test_config_checks.py lists every place
that raises a ConfigError.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mppo.config import ConfigError, MppoConfig, load_config
from mppo.config.lora import check_lora_model
from mppo.errors import UserError

MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"


class VocabMismatchError(UserError, ValueError):
    """The tokenizer has token ids the model has no embedding rows for."""


def load_checked(path: str | None, overrides: list[str], *, world_size: int | None = None,
                 planning: bool = False) -> tuple[MppoConfig, list[str]]:
    """The config of `mppo train` (with or without --dry-run) and of `mppo plan`: loaded and validated, then
    check_run (a UserError otherwise); with its warnings, one line each: the config's own and, when `planning`,
    what the run needs that this machine lacks."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path, overrides, world_size=world_size)
    notes = [str(w.message) for w in caught]
    notes += check_run(cfg, planning=planning)
    return cfg, notes


def print_warnings(notes: Sequence[str]) -> None:
    """Each warning once, one line each, on stderr (stdout keeps the config or the plan)."""
    for note in dict.fromkeys(notes):
        print(f"mppo: warning: {note}", file=sys.stderr)


def check_run(cfg: MppoConfig, *, planning: bool = False) -> list[str]:
    """Raise the first environment problem of a validated config (see the module docstring). With `planning` the
    run is for another machine: a missing rollout package is a returned warning line, and neither this machine's
    device nor the run's own inputs are checked."""
    notes = []
    if planning:
        notes += [w for w in [rollout_package_warning(cfg)] if w is not None]
    else:
        for check in (check_rollout_package, check_transformer_impl, check_device, check_recompute,
                      check_rollout_launch):
            check(cfg)
    check_models(cfg)
    if not planning:
        check_inputs(cfg)
    return notes


# ---------------------------------------------------------------------------------------------------- the machine
def check_rollout_package(cfg: MppoConfig) -> None:
    """The engine's package and version on this machine: MissingGpuPackageError, one line naming the fix."""
    if cfg.actor_rollout_ref.rollout.name != "sglang":
        return
    from mppo.models.spec import MissingGpuPackageError
    from mppo.rollout.sglang_protocol import installed_sglang_version

    try:
        installed_sglang_version()
    except ImportError as exc:
        raise MissingGpuPackageError(f"actor_rollout_ref.rollout.name=sglang: {exc}; or use "
                                     "actor_rollout_ref.rollout.name=cpu") from None


def rollout_package_warning(cfg: MppoConfig) -> str | None:
    """What check_rollout_package would refuse, as one warning line for planning on another machine than the run's
    (a login node, a laptop): the run needs the engine, its plan does not. None when this machine has it."""
    from mppo.models.spec import MissingGpuPackageError

    try:
        check_rollout_package(cfg)
    except MissingGpuPackageError:
        from mppo.rollout.sglang_protocol import INSTALL_HINT, SUPPORTED_SGLANG, sglang_version_here

        version = sglang_version_here()
        here = "SGLang is not installed here" if version is None else \
            f"SGLang is not installed here in a version the run can use (found sglang {version})"
        return (f"{here}; the run needs it (actor_rollout_ref.rollout.name=sglang: sglang{SUPPORTED_SGLANG}): "
                f"{INSTALL_HINT}")
    return None


def check_transformer_impl(cfg: MppoConfig) -> None:
    """transformer_impl=te needs Transformer Engine and CUDA (MissingGpuPackageError)."""
    from mppo.models.spec import resolve_transformer_impl

    resolve_transformer_impl(cfg.actor_rollout_ref.model.transformer_impl)


def uses_cuda(cfg: MppoConfig) -> bool:
    """Whether the run trains on CUDA devices: trainer.device=cuda, or auto with a CUDA device visible."""
    import torch

    return cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())


def check_device(cfg: MppoConfig) -> None:
    """trainer.device must match what this process can use: mppo trains on every visible GPU (nccl), or on the
    CPU (gloo) when none is visible. A mismatch is an error rather than a silent switch of device."""
    import torch

    requested, has_cuda = cfg.trainer.device, torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError("trainer.device=cuda but this process sees no CUDA device (torch.cuda.is_available() is "
                          "False): check CUDA_VISIBLE_DEVICES and that torch is a CUDA build, or set "
                          "trainer.device=cpu")
    if requested == "cpu" and has_cuda:
        raise ConfigError("trainer.device=cpu but CUDA devices are visible, and mppo trains on every visible GPU: "
                          "hide them to train on the CPU (CUDA_VISIBLE_DEVICES= mppo train ...), or set "
                          "trainer.device=auto to use them")


def check_recompute(cfg: MppoConfig) -> None:
    """megatron-core's activation checkpointing saves and restores CUDA RNG states: no recomputation on the CPU."""
    if uses_cuda(cfg):
        return
    roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.megatron)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.megatron))
    for role, megatron in roles:
        if megatron.recompute in ("selective", "full"):
            raise ConfigError(f"{role}.megatron.recompute={megatron.recompute} needs CUDA: megatron-core's "
                              "activation checkpointing saves and restores CUDA RNG states; use "
                              f"{role}.megatron.recompute=none on CPU")


def check_rollout_launch(cfg: MppoConfig) -> None:
    """An engine's ranks lie on one node of this launch: its TP divides torchrun's ranks per node (the config's
    trainer.n_gpus_per_node is checked by validate; a launch may be shaped otherwise). A separate placement's
    engine ranks are checked by mppo.parallel.placement, which knows their node."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    engine_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if local_world is None or not cfg.actor_rollout_ref.hybrid_engine or int(local_world) % engine_tp == 0:
        return
    raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size = {engine_tp}: an engine's ranks must "
                      f"lie on one node, but it does not divide the {local_world} ranks per node of this launch "
                      f"(LOCAL_WORLD_SIZE); use a divisor of {local_world}")


# ----------------------------------------------------------------------------------------- the model directories
def _model_paths(cfg: MppoConfig) -> list[str]:
    """The model directories the run reads (the reference policy is the actor's model)."""
    model = cfg.actor_rollout_ref.model
    paths = [model.path] + ([cfg.critic.model.path] if cfg.critic.enable else [])
    return list(dict.fromkeys(p for p in paths if p))


def check_models(cfg: MppoConfig) -> None:
    """Stop on a model mppo cannot map (an unknown model_type, an unsupported MoE variant such as shared experts or
    another router), on LoRA it cannot adapt, on a model the rollout engine would serve wrong, and on a model or
    tokenizer that needs its own code while actor_rollout_ref.model.trust_remote_code is false
    (mppo.models.remote_code): one line naming the file and key, before megatron is imported. A directory without
    config.json is left to check_inputs (planning does not need it)."""
    from mppo.models.hf_config import read_hf_config
    from mppo.models.remote_code import check_remote_code

    model = cfg.actor_rollout_ref.model
    for path in _model_paths(cfg):
        if (Path(path).expanduser() / "config.json").is_file():
            facts = read_hf_config(Path(path).expanduser())
            if path == model.path:
                check_lora_model(cfg, facts.model_type, facts.is_moe)
    if cfg.actor_rollout_ref.rollout.name == "sglang":
        check_sglang_serves(model.path)
    for path in dict.fromkeys(p for p in [*_model_paths(cfg), model.tokenizer_path] if p):
        check_remote_code(path, model.trust_remote_code)


def check_sglang_serves(model_path: str | None) -> None:
    """SGLang 0.5.23's Qwen3-MoE builds every layer as a MoE layer (Qwen3MoeDecoderLayer.stage_facts ignores
    mlp_only_layers and decoder_sparse_step) and never ties its head to the embedding (tie_word_embeddings is not
    read; the head stays unloaded): such a model would roll out wrong log-probs, so it stops here
    (tests/test_rollout_sglang_cpu.py pins the first limitation; released Qwen3-MoE checkpoints have neither)."""
    from mppo.models.hf_config import read_hf_config

    config = Path(model_path) / "config.json" if model_path else None
    if config is None or not config.is_file() or json.loads(config.read_text()).get("model_type") != "qwen3_moe":
        return
    args = read_hf_config(config)
    dense = [i for i in range(args.num_layers) if i not in args.moe_layers]
    if args.moe_layers and dense:
        raise ConfigError(f"actor_rollout_ref.rollout.name = 'sglang': the Qwen3-MoE at {model_path!r} has dense "
                          f"layers {dense} (mlp_only_layers / decoder_sparse_step), which SGLang 0.5.23 builds as "
                          "MoE layers (it would serve wrong log-probs); use actor_rollout_ref.rollout.name=cpu")
    if json.loads(config.read_text()).get("tie_word_embeddings"):
        raise ConfigError(f"actor_rollout_ref.rollout.name = 'sglang': the Qwen3-MoE at {model_path!r} ties its head "
                          "to the embedding (tie_word_embeddings), which SGLang 0.5.23's Qwen3-MoE does not do (it "
                          "would serve wrong log-probs); use actor_rollout_ref.rollout.name=cpu")


# ---------------------------------------------------------------------------------------------- the run's inputs
def check_inputs(cfg: MppoConfig) -> None:
    """What the run reads and planning does not: the model directories (each with its config.json) and
    data.train_files (the files themselves are the data loader's to open, naming what is wrong inside)."""
    hf_dir = "give an HF model directory (config.json + safetensors), e.g. one written by `mppo convert` or " \
             "save_pretrained"
    require_model_dir(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path", hf_dir)
    if cfg.critic.enable:
        require_model_dir(cfg.critic.model.path, "critic.model.path", hf_dir)
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is not set; make data with e.g. `mppo data countdown --out "
                          "data/countdown`")


def require_model_dir(value: str | None, key: str, hint: str) -> None:
    """`key` names an existing directory with a readable config.json."""
    if not value:
        raise ConfigError(f"{key} is not set; {hint}")
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{key}={value!r} does not exist; {hint}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{value!r} has no config.json; {hint}")
    try:
        json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {config_file} ({type(err).__name__}: {err}); restore the model's "
                          "config.json") from err


# ------------------------------------------------------------------------------------------ loaded objects
def check_tokenizer(cfg: MppoConfig, tokenizer: Any) -> None:
    """The run's tokenizer, once loaded: every id it produces has an embedding row in each model that reads it,
    and with multi-turn rollout its chat template renders tool turns."""
    from mppo.models.hf_config import model_facts

    models = {cfg.actor_rollout_ref.model.path: "actor_rollout_ref.model.path"}
    if cfg.critic.enable:
        models.setdefault(cfg.critic.model.path, "critic.model.path")
    for path, key in models.items():
        vocab_size = model_facts(path)["vocab_size"]
        if vocab_size is not None and len(tokenizer) > vocab_size:
            raise VocabMismatchError(
                f"the tokenizer has {len(tokenizer)} tokens but the model at {key}={path!r} has vocab_size "
                f"{vocab_size}: token ids >= {vocab_size} have no embedding. Use the tokenizer that belongs to this "
                "model (actor_rollout_ref.model.tokenizer_path), or resize the model's embeddings first")
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        check_multi_turn_template(cfg, tokenizer)


def check_multi_turn_template(cfg: MppoConfig, tokenizer: Any) -> None:
    """multi_turn: turns end at stop tokens, and the tokenizer's chat template renders a tool turn after earlier
    turns unchanged (the agent loop appends each turn's tokens to the conversation's)."""
    from mppo.rollout.agent_loop import TOOL_CALL_END, tool_call_stop_id, tool_turn_ids

    if cfg.actor_rollout_ref.rollout.ignore_eos:
        raise ConfigError(f"{MULTI_TURN}.enable=true with actor_rollout_ref.rollout.ignore_eos=true: turns end at "
                          "stop tokens (eos, the end of a tool call), which ignore_eos disables; set ignore_eos=false")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{MULTI_TURN}.enable=true but the tokenizer of actor_rollout_ref.model has no chat "
                          "template: tool turns are rendered by it; use an instruct model's tokenizer "
                          "(actor_rollout_ref.model.tokenizer_path)")
    try:
        tool_turn_ids(tokenizer, ["0"])
    except Exception as err:  # noqa: BLE001 - a template error of any kind is the user's template
        raise ConfigError(f"{MULTI_TURN}.enable=true: the tokenizer's chat template cannot append a tool turn "
                          f"({type(err).__name__}: {str(err)[:160]}); use a template with a 'tool' role that "
                          "renders earlier turns unchanged") from None
    stop_id = tool_call_stop_id(tokenizer)
    if tokenizer.eos_token_id is not None and stop_id == tokenizer.eos_token_id:
        raise ConfigError(f"{MULTI_TURN}: {TOOL_CALL_END!r} ends in the tokenizer's eos token; turns could not "
                          "tell a tool call from the end of the answer")


def check_train_data(cfg: MppoConfig, dataset: Any) -> None:
    """The training data, once loaded: without reward.custom_fn, a built-in scorer for every data_source and
    reward_model.style in it."""
    if cfg.reward.custom_fn.path:
        return
    from mppo.data.dataset import REWARD_STYLE_KEY
    from mppo.rewards import known_data_sources
    from mppo.rewards.answer import REWARD_STYLES

    sources = {dataset[i].data_source for i in range(len(dataset))}
    unknown = sources - set(known_data_sources())
    if unknown:
        raise ConfigError(f"no built-in reward for data_source {sorted(unknown)} (known: {known_data_sources()}); "
                          "set reward.custom_fn.path to your own scorer")
    styles = {dataset[i].extra_info.get(REWARD_STYLE_KEY, "rule") for i in range(len(dataset))}
    if styles - set(REWARD_STYLES):
        raise ConfigError(f"reward_model.style {sorted(styles - set(REWARD_STYLES))} in {cfg.data.train_files} has "
                          f"no built-in scorer (known: {REWARD_STYLES}); set reward.custom_fn.path")
