"""Building a run's parts from its config: data, tokenizer, reward, sampling. The fit loop only wires them (the
rollout engines come from mppo.rollout.factory).

The checks here run before megatron is imported or a model is built, so bad input stops a run in seconds.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mppo.config import ConfigError, MppoConfig
from mppo.data import PromptLoader, RLDataset, load_tokenizer
from mppo.errors import UserError
from mppo.preflight import check_config
from mppo.rewards import RewardManager, known_data_sources, resolve_compute_score
from mppo.data.dataset import REWARD_STYLE_KEY
from mppo.rewards.answer import REWARD_STYLES
from mppo.rollout.base import SamplingParams

log = logging.getLogger("mppo")


def require_path(value: str | None, key: str, hint: str) -> str:
    if not value:
        raise ConfigError(f"{key} is not set; {hint}")
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{key}={value!r} does not exist; {hint}")
    return str(path)


class VocabMismatchError(UserError, ValueError):
    """The tokenizer has token ids the model has no embedding rows for."""


# What makes a model "the same model" for a resume: its architecture as config.json states it.
MODEL_FACTS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def model_facts(model_path: str) -> dict[str, Any]:
    """The architecture facts of the HF model at `model_path` (from its config.json)."""
    config_file = Path(model_path).expanduser() / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{model_path!r} has no config.json; give an HF model directory (config.json + "
                          "safetensors), e.g. one written by `mppo convert` or save_pretrained")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {config_file} ({type(err).__name__}: {err}); restore the model's "
                          "config.json") from err
    facts = {key: config.get(key) for key in MODEL_FACTS}
    # dropout changes what an update computes; listed only when set, so older checkpoints of models without it resume
    facts.update({key: config[key] for key in ("attention_dropout", "hidden_dropout") if config.get(key)})
    return facts


def check_startup(cfg: MppoConfig) -> None:
    """What stops a run at start-up, in seconds, before megatron is imported or any model is built: check_config,
    then what this machine must have (the GPU packages the config asks for, its device): `--dry-run` and
    `mppo plan` only warn of a missing package, the run stops here."""
    from mppo.models.spec import resolve_transformer_impl
    from mppo.rollout.factory import check_rollout_package

    check_config(cfg)
    check_rollout_package(cfg)  # raises MissingGpuPackageError
    resolve_transformer_impl(cfg.actor_rollout_ref.model.transformer_impl)  # raises MissingGpuPackageError
    check_device(cfg)


def check_device(cfg: MppoConfig) -> None:
    """trainer.device must match what this process can use: mppo trains on every visible GPU (nccl), or on the
    CPU (gloo) when none is visible. A mismatch is an error rather than a silent switch of device."""
    requested, has_cuda = cfg.trainer.device, torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError("trainer.device=cuda but this process sees no CUDA device (torch.cuda.is_available() is "
                          "False): check CUDA_VISIBLE_DEVICES and that torch is a CUDA build, or set "
                          "trainer.device=cpu")
    if requested == "cpu" and has_cuda:
        raise ConfigError("trainer.device=cpu but CUDA devices are visible, and mppo trains on every visible GPU: "
                          "hide them to train on the CPU (CUDA_VISIBLE_DEVICES= mppo train ...), or set "
                          "trainer.device=auto to use them")


def check_vocab(tokenizer: Any, model_path: str, key: str) -> None:
    """Every token id the tokenizer can produce must have an embedding row in the model."""
    vocab_size = model_facts(model_path)["vocab_size"]
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise VocabMismatchError(
            f"the tokenizer has {len(tokenizer)} tokens but the model at {key}={model_path!r} has vocab_size "
            f"{vocab_size}: token ids >= {vocab_size} have no embedding. Use the tokenizer that belongs to this "
            "model (actor_rollout_ref.model.tokenizer_path), or resize the model's embeddings first")


@dataclass
class RunData:
    tokenizer: Any
    train_loader: PromptLoader
    val_dataset: RLDataset | None
    reward: RewardManager


def build_data(cfg: MppoConfig) -> RunData:
    model_path = require_path(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path",
                              "give an HF model directory (config.json + safetensors)")
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path or model_path,
                               trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # veRL does the same for tokenizers without a pad token
    check_vocab(tokenizer, model_path, "actor_rollout_ref.model.path")
    if cfg.critic.enable and cfg.critic.model.path and cfg.critic.model.path != model_path:
        check_vocab(tokenizer, require_path(cfg.critic.model.path, "critic.model.path", "give an HF model "
                                            "directory"), "critic.model.path")
    hint = "make data with e.g. `mppo data countdown --out data/countdown`"
    if not cfg.data.train_files:
        raise ConfigError(f"data.train_files is not set; {hint}")
    dataset_kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                          filter_overlong_prompts=True if cfg.data.filter_overlong_prompts else "error")
    train = RLDataset(cfg.data.train_files, tokenizer, **dataset_kwargs)
    val = RLDataset(cfg.data.val_files, tokenizer, **dataset_kwargs) if cfg.data.val_files else None
    for name, ds in (("train", train), ("val", val)):
        if ds is not None and ds.num_dropped_overlong:
            log.warning("%s data: dropped %d prompts longer than data.max_prompt_length=%d", name,
                        ds.num_dropped_overlong, cfg.data.max_prompt_length)
    compute_score = resolve_compute_score(cfg.reward.custom_fn.path, cfg.reward.custom_fn.name)
    if not cfg.reward.custom_fn.path:
        sources = {train[i].data_source for i in range(len(train))}
        unknown = sources - set(known_data_sources())
        if unknown:
            raise ConfigError(f"no built-in reward for data_source {sorted(unknown)} (known: "
                              f"{known_data_sources()}); set reward.custom_fn.path to your own scorer")
        styles = {train[i].extra_info.get(REWARD_STYLE_KEY, "rule") for i in range(len(train))}
        if styles - set(REWARD_STYLES):
            raise ConfigError(f"reward_model.style {sorted(styles - set(REWARD_STYLES))} in {cfg.data.train_files} "
                              f"has no built-in scorer (known: {REWARD_STYLES}); set reward.custom_fn.path")
    # Each batch is one generation batch: dynamic sampling (algorithm.filter_groups) may use several per step.
    loader = PromptLoader(train, cfg.data.gen_batch_size or cfg.data.train_batch_size,
                          pad_token_id=tokenizer.pad_token_id,
                          shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    return RunData(tokenizer=tokenizer, train_loader=loader, val_dataset=val,
                   reward=RewardManager(tokenizer, compute_score, format_score=cfg.reward.format_score))


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return tuple(sorted(ids))


def train_sampling(cfg: MppoConfig, tokenizer: Any) -> SamplingParams:
    r = cfg.actor_rollout_ref.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_token_ids(tokenizer),
                          seed=cfg.trainer.seed, do_sample=True, ignore_eos=r.ignore_eos)


def val_sampling(cfg: MppoConfig, tokenizer: Any) -> SamplingParams:
    v = cfg.actor_rollout_ref.rollout.val_kwargs
    return SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                          max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_token_ids(tokenizer),
                          seed=cfg.trainer.seed, do_sample=v.do_sample,
                          # veRL sets ignore_eos on the engine, so validation requests run to the limit too
                          ignore_eos=cfg.actor_rollout_ref.rollout.ignore_eos)
