"""Turning generated responses into token-level scores (veRL's NaiveRewardManager, TinyZero's decoding).

Each sample's text is its decoded valid prompt tokens followed by its decoded valid response tokens, special
tokens kept (TinyZero's RewardManager: the countdown scorer looks for "Assistant:" or "<|im_start|>assistant",
which the prompt carries). The sample's score goes on its last valid response token; every other position is 0.

A reward function that raises, or returns something that is not a finite number, costs only that sample: it
scores 0, is counted in `reward/errors`, and the first such traceback of the run is logged; the last failure is
kept (`last_error`) for the trainer, which stops a run whose every response fails to score for
`reward.max_failed_steps` steps in a row. A RewardConfigError (e.g. an unknown data_source) is a setup problem, not
a sample problem, and propagates.

`score_with_info` also returns veRL's reward_extra_info as numbers per response (dynamic sampling may filter on
them, algorithm.filter_groups.metric): a dict return's numeric values by key, and for a number return `acc` = that
number (veRL's DAPO reward manager). A response that failed to score or was empty has 0 for each key (as its
score); one whose function did not return a key has NaN there.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mppo.rewards.registry import ComputeScore, RewardConfigError, default_compute_score

logger = logging.getLogger(__name__)


class RewardManager:
    def __init__(self, tokenizer: Any, compute_score: ComputeScore = default_compute_score,
                 format_score: float | None = None) -> None:
        """`tokenizer` needs `decode(ids, skip_special_tokens=...)`. `format_score`, when set, is passed to
        `compute_score` as a keyword (overriding the task's default for well-formed wrong answers)."""
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.format_score = format_score
        self.total_errors = 0  # over the manager's life (one run); the first one's traceback is logged
        self.last_error: str | None = None  # "TypeError: ..." of the latest failure, for the trainer's stop message

    def __call__(self, prompts: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor, response_ids: torch.Tensor,
                 response_mask: torch.Tensor, data_sources: Sequence[str], ground_truths: Sequence[Any],
                 extra_infos: Sequence[Any] | None = None, *, prompt_mask: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """Score a batch.

        prompts: the prompt texts, or each prompt's valid token ids, or a padded [bs, P] id tensor together with
            `prompt_mask` (1 on valid tokens).
        response_ids, response_mask: [bs, T]; the mask is 1 on the response's valid tokens.
        Returns (token_level_scores [bs, T] float32, metrics {"reward/errors", "reward/empty_responses"}).
        """
        scores, metrics, _ = self.score_with_info(prompts, response_ids, response_mask, data_sources, ground_truths,
                                                  extra_infos, prompt_mask=prompt_mask)
        return scores, metrics

    def score_with_info(self, prompts: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor,
                        response_ids: torch.Tensor, response_mask: torch.Tensor, data_sources: Sequence[str],
                        ground_truths: Sequence[Any], extra_infos: Sequence[Any] | None = None, *,
                        prompt_mask: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
        """As __call__, and the reward extra info: key -> float32 [bs] (see the module docstring)."""
        batch_size = response_ids.shape[0]
        if response_mask.shape != response_ids.shape:
            raise ValueError(f"response_mask shape {tuple(response_mask.shape)} differs from response_ids shape "
                             f"{tuple(response_ids.shape)}")
        for name, column in (("prompts", prompts), ("data_sources", data_sources), ("ground_truths", ground_truths),
                             ("extra_infos", extra_infos)):
            if column is not None and len(column) != batch_size:
                raise ValueError(f"{name} has {len(column)} entries but the batch has {batch_size} responses")
        prompt_texts = self._prompt_texts(prompts, prompt_mask)

        scores = torch.zeros(response_ids.shape, dtype=torch.float32)
        errors = empty = 0
        infos: list[dict[str, float] | None] = [None] * batch_size  # None: failed or empty (0 for every key)
        for i in range(batch_size):
            valid = response_mask[i].nonzero().flatten()
            if valid.numel() == 0:
                empty += 1  # nothing to put a score on: the sample contributes no reward
                continue
            response_text = self.tokenizer.decode(response_ids[i][response_mask[i].bool()].tolist(),
                                                  skip_special_tokens=False)
            extra_info = None if extra_infos is None else extra_infos[i]
            scored = self._score_one(data_sources[i], prompt_texts[i] + response_text, ground_truths[i], extra_info)
            if scored is None:
                errors += 1
                continue
            scores[i, int(valid[-1])], infos[i] = scored
        keys = dict.fromkeys(k for info in infos if info for k in info)
        extra = {k: torch.tensor([0.0 if info is None else info.get(k, math.nan) for info in infos],
                                 dtype=torch.float32) for k in keys}
        return scores, {"reward/errors": float(errors), "reward/empty_responses": float(empty)}, extra

    def _prompt_texts(self, prompts: Any, prompt_mask: torch.Tensor | None) -> list[str]:
        if isinstance(prompts, torch.Tensor):
            if prompt_mask is None:
                raise ValueError("prompts given as a padded id tensor need prompt_mask (1 on valid tokens)")
            rows = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask)]
        else:
            rows = list(prompts)
        return [row if isinstance(row, str) else self.tokenizer.decode(list(row), skip_special_tokens=False)
                for row in rows]

    def _score_one(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any
                   ) -> tuple[float, dict[str, float]] | None:
        """The sample's (score, extra info), or None when the reward function failed (logged once per run)."""
        kwargs = {} if self.format_score is None else {"format_score": self.format_score}
        try:
            result = self.compute_score(data_source=data_source, solution_str=solution_str,
                                        ground_truth=ground_truth, extra_info=extra_info, **kwargs)
            score = _as_score(result)
            return score, (_numeric_items(result) if isinstance(result, Mapping) else {"acc": score})
        except RewardConfigError:
            raise
        except Exception as err:
            self.last_error = f"{type(err).__name__}: {str(err)[:300]}"
            if self.total_errors == 0:
                logger.exception("reward function failed on a %r sample; it scores 0 and is counted in "
                                 "reward/errors (only this first traceback of the run is logged)", data_source)
            self.total_errors += 1
            return None


def reward_function_name(compute_score: ComputeScore) -> str:
    """How a stop message names the reward function: module.qualname (a user file's function as file:name)."""
    module = getattr(compute_score, "__module__", None) or "?"
    name = getattr(compute_score, "__qualname__", None) or type(compute_score).__name__
    source = getattr(getattr(compute_score, "__code__", None), "co_filename", "")
    return f"{source}:{name}" if source and not module.startswith("mppo.") else f"{module}.{name}"


def _numeric_items(result: Mapping) -> dict[str, float]:
    """The finite numbers (bools, one-element tensors) of a dict return; text such as a parsed answer is left out."""
    out = {}
    for key, value in result.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out[str(key)] = float(value)
    return out


def _as_score(result: Any) -> float:
    """A reward function may return a number or veRL's dict form {"score": number, ...}."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"reward function returned a dict without 'score': keys {sorted(result)}")
        result = result["score"]
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    if not isinstance(result, numbers.Real):
        raise TypeError(f"reward function returned {type(result).__name__}, expected a number")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite score {value}")
    return value
