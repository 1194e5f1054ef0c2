"""The "natural" reward style: instruct models asked a plain question in their own chat template are scored on
the answer as they write it (an <answer> tag if any, else the last number / the last expression), through the
dataset's reward_model.style and the registry, on hand-written chat texts."""
from __future__ import annotations

import pytest

from mppo.rewards import countdown, gsm8k, multiply
from mppo.rewards.answer import last_expression, last_number
from mppo.rewards.registry import RewardConfigError, default_compute_score

# SmolLM2's chat template (ChatML with a default system turn), written out by hand.
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def chat(question: str, answer: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>"


MUL_Q = "What is 7 * 8? Answer with a number."


@pytest.mark.parametrize("answer, expected", [
    ("56", 1.0),
    ("7 * 8 = 56.", 1.0),
    ("The answer is 56.", 1.0),
    ("To calculate 7 * 8, multiply 7 by 8, which gives 56. So, 7 * 8 = 56.", 1.0),
    ("<answer> 56 </answer>", 1.0),
    ("<answer>\n56\n</answer> I hope this helps, 3 times over.", 1.0),  # a tag wins over later numbers
    ("It is 1,056.", 0.05),  # thousands commas are read as one number
    ("To calculate 7 * 8, you multiply 7 by itself, which is 49.", 0.05),
    ("The answer is 56 or 57", 0.05),  # the last number counts
    ("I do not know.", 0.0),  # no number: nothing to score
    ("", 0.0),
])
def test_multiply_natural(answer, expected):
    assert multiply.compute_score(chat(MUL_Q, answer), 56, style="natural") == expected


def test_natural_ignores_the_question_and_needs_an_assistant_turn():
    # The question's own numbers (7, 8) are not the model's answer, whatever the product.
    assert multiply.compute_score(chat("What is 1 * 8?", "Hmm."), 8, style="natural") == 0.0
    # Without a marker the scorer cannot split question from answer: 0, not the question's last number.
    assert multiply.compute_score("What is 1 * 8? 8", 8, style="natural") == 0.0
    assert multiply.compute_score("User: What is 1 * 8?\nAssistant: 8", 8, style="natural") == 1.0
    llama3 = ("<|start_header_id|>user<|end_header_id|>\n\nWhat is 1 * 8?<|eot_id|><|start_header_id|>assistant"
              "<|end_header_id|>\n\nIt is 8.<|eot_id|>")
    assert multiply.compute_score(llama3, 8, style="natural") == 1.0
    # The rule style is unchanged: no tags, no score.
    assert multiply.compute_score(chat(MUL_Q, "7 * 8 = 56."), 56) == 0.0
    with pytest.raises(ValueError, match="reward style"):
        multiply.compute_score(chat(MUL_Q, "56"), 56, style="loose")


CD_Q = "Using the numbers [3, 5, 7], create an equation that equals 22. Use +, -, * or / and each number exactly once."
CD_GT = {"target": 22, "numbers": [3, 5, 7]}


@pytest.mark.parametrize("answer, expected", [
    ("3 * 5 + 7 = 22", 1.0),
    ("We can write (3 * 5) + 7.", 1.0),
    ("First, 3 * 5 = 15. Then 15 + 7 = 22. So the equation is 3 * 5 + 7 = 22.", 1.0),
    ("The equation is 7 + 5 × 3 = 22", 1.0),  # unicode times
    ("<answer> 7 + 3 * 5 </answer> and some more text 1 + 1", 1.0),  # the tag wins
    ("First, 3 * 5 = 15. Then 15 + 7 = 22.", 0.1),  # the last expression, 15 + 7, does not use the numbers given
    ("3 + 5 + 7 = 15", 0.1),
    ("The answer is 22.", 0.0),  # no expression at all
    ("I cannot do step-by-step math - sorry.", 0.0),
])
def test_countdown_natural(answer, expected):
    assert countdown.compute_score(chat(CD_Q, answer), CD_GT, style="natural") == expected


def test_last_number_and_last_expression_by_hand():
    assert last_number("a 12, b 3.5, c 1,234.") == "1234"
    assert last_number("3, 5 and 7") == "7"
    assert last_number("minus -4") == "-4"
    assert last_number("none") is None
    assert last_number("9" * 10_000) is not None  # long digit runs are cut into bounded numbers, no crash
    assert last_expression("so 2 + 2 = 4 and (1 + 2) * 3 = 9.") == "(1 + 2) * 3"
    assert last_expression("just 42.") is None
    assert last_expression("x" + " 1 +" * 5000) is None  # nothing parses; bounded work


GSM_Q = "Natalia sold 48 clips in April and half as many in May. How many did she sell?"


@pytest.mark.parametrize("answer, expected", [
    ("She sold 48 + 24 = 72 clips.", 1.0),
    ("48 / 2 = 24, 48 + 24 = 72\n#### 72", 1.0),
    ("#### 72 (that is 48 + 24)", 1.0),  # '####' wins over the last number
    ("The answer is $72.00.", 1.0),  # compared as a number
    ("<answer> 72 </answer> because 48 + 24", 1.0),
    ("She sold 48 + 12 = 60 clips.", 0.0),
    ("No idea.", 0.0),
])
def test_gsm8k_natural(answer, expected):
    assert gsm8k.compute_score(chat(GSM_Q, answer), "72", style="natural") == expected


def test_registry_reads_the_style_from_extra_info():
    text = chat(MUL_Q, "7 * 8 = 56.")
    assert default_compute_score("multiply", text, 56, extra_info={"reward_style": "natural"}) == 1.0
    assert default_compute_score("multiply", text, 56, extra_info={"index": 3}) == 0.0  # rule style
    assert default_compute_score("multiply", text, 56, extra_info=None) == 0.0
    assert default_compute_score("countdown", chat(CD_Q, "3 * 5 + 7"), CD_GT,
                                 extra_info={"reward_style": "natural"}) == 1.0
    with pytest.raises(RewardConfigError, match="reward style 'model'"):
        default_compute_score("multiply", text, 56, extra_info={"reward_style": "model"})
