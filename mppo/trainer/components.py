"""Building a run's parts from its config: data, tokenizer, reward, sampling. The fit loop only wires them (the
rollout engines come from mppo.rollout.factory).

What the run's config and environment must satisfy was checked before (mppo.config.validate, mppo.preflight); the
tokenizer and the training data are checked by mppo.preflight as soon as they are loaded, before megatron is
imported or a model is built, so bad input stops a run in seconds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mppo import preflight
from mppo.config import MppoConfig
from mppo.data import PromptLoader, RLDataset, load_tokenizer
from mppo.rewards import RewardManager, resolve_compute_score
from mppo.rollout.base import SamplingParams

log = logging.getLogger("mppo")


@dataclass
class RunData:
    tokenizer: Any
    train_loader: PromptLoader
    val_dataset: RLDataset | None
    reward: RewardManager


def build_data(cfg: MppoConfig) -> RunData:
    """The tokenizer, the data and the reward function of a run whose config passed mppo.preflight.check_run."""
    model = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # veRL does the same for tokenizers without a pad token
    preflight.check_tokenizer(cfg, tokenizer)
    dataset_kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                          filter_overlong_prompts=True if cfg.data.filter_overlong_prompts else "error")
    train = RLDataset(cfg.data.train_files, tokenizer, **dataset_kwargs)
    val = RLDataset(cfg.data.val_files, tokenizer, **dataset_kwargs) if cfg.data.val_files else None
    for name, ds in (("train", train), ("val", val)):
        if ds is not None and ds.num_dropped_overlong:
            log.warning("%s data: dropped %d prompts longer than data.max_prompt_length=%d", name,
                        ds.num_dropped_overlong, cfg.data.max_prompt_length)
    compute_score = resolve_compute_score(cfg.reward.custom_fn.path, cfg.reward.custom_fn.name)
    preflight.check_train_data(cfg, train)
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
