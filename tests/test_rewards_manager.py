"""RewardManager: the score lands on the last valid response token; failing reward functions cost one sample."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from mppo.rewards.manager import RewardManager
from mppo.rewards.registry import RewardConfigError, default_compute_score

PAD = 0


class CharTokenizer:
    """One token per character (id = code point), so expected texts are easy to write by hand."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


TOK = CharTokenizer()
PROMPT = "User: use [3, 5, 7] to make 22.\nAssistant: <think>"
GT = {"target": 22, "numbers": [3, 5, 7]}


def _responses(texts: list[str], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(texts), width), PAD, dtype=torch.int64)
    mask = torch.zeros((len(texts), width), dtype=torch.int64)
    for row, text in enumerate(texts):
        if text:
            ids[row, :len(text)] = torch.tensor(TOK.encode(text), dtype=torch.int64)
            mask[row, :len(text)] = 1
    return ids, mask


RESPONSES = ["</think>\n<answer> 3*5+7 </answer>", "</think>\n<answer> 3+5+7 </answer>", "", "</think> none"]


def test_score_is_on_the_last_valid_token():
    ids, mask = _responses(RESPONSES, width=48)
    scores, metrics = RewardManager(TOK)([PROMPT] * 4, ids, mask, ["countdown"] * 4, [GT] * 4, [{}] * 4)
    assert scores.dtype == torch.float32 and scores.shape == (4, 48)
    expected = torch.zeros(4, 48)
    expected[0, len(RESPONSES[0]) - 1] = 1.0
    expected[1, len(RESPONSES[1]) - 1] = 0.1
    # row 2 is empty: no token to carry a score; row 3 has no answer: 0
    assert torch.equal(scores, expected)
    assert metrics == {"reward/errors": 0.0, "reward/empty_responses": 1.0}


def test_prompt_forms_agree():
    ids, mask = _responses(RESPONSES[:2], width=40)
    manager = RewardManager(TOK)
    by_text, _ = manager([PROMPT, PROMPT], ids, mask, ["countdown"] * 2, [GT] * 2)
    by_ids, _ = manager([TOK.encode(PROMPT)] * 2, ids, mask, ["countdown"] * 2, [GT] * 2)
    width = len(PROMPT) + 3
    padded = torch.full((2, width), PAD, dtype=torch.int64)
    padded[:, 3:] = torch.tensor(TOK.encode(PROMPT))
    prompt_mask = torch.zeros((2, width), dtype=torch.int64)
    prompt_mask[:, 3:] = 1
    by_tensor, _ = manager(padded, ids, mask, ["countdown"] * 2, [GT] * 2, prompt_mask=prompt_mask)
    assert by_text[0].sum() == 1.0 and by_text[1].sum() == pytest.approx(0.1)
    assert torch.equal(by_text, by_ids) and torch.equal(by_text, by_tensor)
    with pytest.raises(ValueError, match="prompt_mask"):
        manager(padded, ids, mask, ["countdown"] * 2, [GT] * 2)
    with pytest.raises(ValueError, match="ground_truths has 1"):
        manager([PROMPT] * 2, ids, mask, ["countdown"] * 2, [GT])


def test_failing_reward_function_scores_zero_and_is_logged_once(caplog):
    calls = []

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(extra_info["i"])
        if extra_info["i"] == 1:
            raise RuntimeError("reward server down")
        if extra_info["i"] == 2:
            return math.nan
        if extra_info["i"] == 3:
            return {"score": 0.75, "acc": True}
        return 0.5

    ids, mask = _responses(["abc", "abcd", "ab", "a"], width=6)
    manager = RewardManager(TOK, flaky)
    with caplog.at_level(logging.ERROR, logger="mppo.rewards.manager"):
        scores, metrics = manager(["p"] * 4, ids, mask, ["x"] * 4, [None] * 4, [{"i": i} for i in range(4)])
        scores2, metrics2 = manager(["p"] * 4, ids, mask, ["x"] * 4, [None] * 4, [{"i": i} for i in range(4)])
    expected = torch.zeros(4, 6)
    expected[0, 2] = 0.5
    expected[3, 0] = 0.75
    assert torch.equal(scores, expected) and torch.equal(scores2, expected)
    assert metrics["reward/errors"] == 2.0 and metrics2["reward/errors"] == 2.0
    assert manager.total_errors == 4
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "reward server down" in caplog.text and "Traceback" in caplog.text
    assert calls == [0, 1, 2, 3] * 2


def test_unknown_data_source_is_a_setup_error_not_a_sample_error():
    ids, mask = _responses(["abc"], width=4)
    with pytest.raises(RewardConfigError, match="known data sources"):
        RewardManager(TOK)(["p"], ids, mask, ["nobody/knows"], [1])


def test_format_score_override_reaches_the_scorer():
    ids, mask = _responses(RESPONSES[:2], width=40)
    scores, _ = RewardManager(TOK, default_compute_score, format_score=0.3)([PROMPT] * 2, ids, mask,
                                                                            ["countdown"] * 2, [GT] * 2)
    assert scores[0].sum() == 1.0 and scores[1].sum() == pytest.approx(0.3)


def test_non_contiguous_mask_uses_the_last_valid_position():
    ids, mask = _responses(["</think> <answer> 3*5+7 </answer>"], width=40)
    mask[0, 2] = 0  # a masked-out token inside the response (e.g. a tool output in multi-turn)
    ids[0, 2] = ord("~")  # would break "</think>" if it were decoded; the answer still parses
    scores, _ = RewardManager(TOK)([PROMPT], ids, mask, ["countdown"], [GT])
    last = int(mask[0].nonzero().max())
    assert scores[0, last] == 1.0 and scores.sum() == 1.0


def test_extra_info_is_the_numbers_each_response_returned():
    """veRL's reward_extra_info per response (dynamic sampling filters on acc / score): a number return is acc,
    a dict return gives its numeric keys; failed and empty responses have 0, a key not returned is NaN."""
    returns = [0.5, {"score": 0.25, "acc": True, "pred": "12", "n": torch.tensor(3)}, RuntimeError("down"),
               {"score": 1.0}, None]

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        result = returns[extra_info["i"]]
        if isinstance(result, Exception):
            raise result
        return result

    ids, mask = _responses(["a", "ab", "abc", "abcd", ""], width=4)
    manager = RewardManager(TOK, fn)
    scores, metrics, extra = manager.score_with_info(["p"] * 5, ids, mask, ["x"] * 5, [None] * 5,
                                                     [{"i": i} for i in range(5)])
    assert sorted(extra) == ["acc", "n", "score"]
    nan = math.nan
    for key, want in {"acc": [0.5, 1.0, 0.0, nan, 0.0], "score": [nan, 0.25, 0.0, 1.0, 0.0],
                      "n": [nan, 3.0, 0.0, nan, 0.0]}.items():
        assert extra[key].dtype == torch.float32
        assert [v if not math.isnan(v) else "nan" for v in extra[key].tolist()] == \
            [v if not math.isnan(v) else "nan" for v in want], key
    assert scores.sum(-1).tolist() == [0.5, 0.25, 0.0, 1.0, 0.0] and metrics["reward/errors"] == 1.0
    plain, plain_metrics = manager(["p"] * 5, ids, mask, ["x"] * 5, [None] * 5, [{"i": i} for i in range(5)])
    assert torch.equal(plain, scores) and plain_metrics == metrics
