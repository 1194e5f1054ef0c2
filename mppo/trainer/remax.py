"""ReMax's baseline (https://arxiv.org/abs/2310.10505): the reward of one greedy response per prompt.

As veRL 0.9.1's `ray_trainer` does for `adv_estimator=remax`: next to the n sampled responses, each prompt gets one
response with `do_sample=False`, scored by the same reward function; `reward_baselines` is that score (summed over
tokens), one per prompt, repeated for the prompt's n samples. The greedy responses are not trained on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from mppo.data.loader import PromptBatch
from mppo.rollout.base import SamplingParams


def greedy_baseline_sampling(sampling: SamplingParams) -> SamplingParams:
    """The training sampling with one greedy response per prompt (veRL: `__do_sample__ = False`)."""
    return replace(sampling, n=1, do_sample=False)


def reward_baselines(greedy_scores: torch.Tensor, n: int) -> torch.Tensor:
    """[B * n] fp32 from the [B, T] token-level scores of the B greedy responses: each prompt's greedy reward, once
    per sampled response (rows in the rollout batch's order: prompt-major, as `build_rollout_batch` lays them out)."""
    return greedy_scores.sum(dim=-1).float().repeat_interleave(n)


class GreedyBaselines:
    """ReMax's input provider (mppo.trainer.estimator_inputs): `reward_baselines` of a generation batch, from a
    greedy rollout of its prompts scored like the sampled ones. `rollout_batch` and `reward` are the fit loop's
    (a collective over every rank, as the sampled rollout)."""

    def __init__(self, rollout_batch: Callable, reward: Callable, sampling: SamplingParams) -> None:
        self.rollout_batch, self.reward, self.sampling = rollout_batch, reward, sampling

    def __call__(self, batch: dict[str, torch.Tensor], prompts: PromptBatch, first_index: int) -> None:
        greedy, greedy_rows = self.rollout_batch(prompts, first_index, greedy_baseline_sampling(self.sampling))
        self.reward(greedy, greedy_rows)
        batch["reward_baselines"] = reward_baselines(greedy["token_level_scores"], self.sampling.n)
