"""ReMax's baseline (https://arxiv.org/abs/2310.10505): the reward of one greedy response per prompt.

As veRL 0.9.1's `ray_trainer` does for `adv_estimator=remax`: next to the n sampled responses, each prompt gets one
response with `do_sample=False`, scored by the same reward function; `reward_baselines` is that score (summed over
tokens), one per prompt, repeated for the prompt's n samples. The greedy responses are not trained on.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from mppo.data.loader import PromptBatch
from mppo.rollout.base import SamplingParams

if TYPE_CHECKING:
    from mppo.trainer.fit import PPOTrainer


def greedy_baseline_sampling(sampling: SamplingParams) -> SamplingParams:
    """The training sampling with one greedy response per prompt (veRL: `__do_sample__ = False`)."""
    return replace(sampling, n=1, do_sample=False)


def reward_baselines(trainer: "PPOTrainer", prompts: PromptBatch, first_index: int, step: int) -> torch.Tensor:
    """[B * n] fp32: the greedy response's reward of each of this DP rank's prompts of the GLOBAL `prompts`, once
    per sampled response (rows in the rollout batch's order: prompt-major, as `build_rollout_batch` lays them out)."""
    baseline = trainer.generate(prompts, first_index, greedy_baseline_sampling(trainer.train_sampling), step)
    scores = baseline["token_level_scores"].sum(dim=-1).float()
    return scores.repeat_interleave(trainer.train_sampling.n)
