"""The bounded arithmetic parser against Python's own evaluation, and on hostile input.

`eval` appears here only on expressions this test generates itself (digits, + - * /, parentheses), never on
model output; it is the independent reference for the parser's precedence and arithmetic.
"""
from __future__ import annotations

import math
import random
import time

import pytest

from mppo.rewards.arith import (
    MAX_EXPRESSION_CHARS,
    MAX_NESTING_DEPTH,
    ParseError,
    evaluate,
    parse_and_evaluate,
)


def _random_expression(rng: random.Random, leaves: int) -> str:
    """A random, Python-valid expression over small ints and decimals with random spacing and parentheses."""
    if leaves == 1:
        if rng.random() < 0.25:
            literal = f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}"
        else:
            literal = str(rng.randint(0, 99))
        if rng.random() < 0.15:
            literal = "-" + literal
        return f"({literal})" if rng.random() < 0.2 else literal
    left = rng.randint(1, leaves - 1)
    op = rng.choice("+-*/")
    space = rng.choice(["", " ", "  "])
    expr = f"{_random_expression(rng, left)}{space}{op}{space}{_random_expression(rng, leaves - left)}"
    roll = rng.random()
    if roll < 0.3:
        return f"({expr})"
    if roll < 0.35:
        return f"-({expr})"
    return expr


def _unicode_operators(rng: random.Random, expr: str) -> str:
    """Randomly spell operators the way models sometimes do: × ÷ and the unicode minus."""
    swaps = {"*": "×", "/": "÷", "-": "−"}
    return "".join(swaps[c] if c in swaps and rng.random() < 0.5 else c for c in expr)


def test_matches_python_on_generated_expressions():
    rng = random.Random(1234)
    checked = zero_divisions = 0
    for _ in range(3000):
        expr = _random_expression(rng, rng.randint(1, 8))
        try:
            expected = eval(expr, {"__builtins__": {}}, {})  # the test's own generated expression
        except ZeroDivisionError:
            with pytest.raises(ParseError, match="division by zero"):
                evaluate(_unicode_operators(rng, expr))
            zero_divisions += 1
            continue
        got = evaluate(_unicode_operators(rng, expr))
        assert math.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-12), (expr, got, expected)
        checked += 1
    assert checked > 2500 and zero_divisions > 0


def test_precedence_and_associativity_by_hand():
    assert evaluate("2 + 3 * 4") == 14
    assert evaluate("(2 + 3) * 4") == 20
    assert evaluate("10 - 4 - 3") == 3  # left-associative
    assert evaluate("64 / 4 / 2") == 8
    assert evaluate("-3 * -2") == 6
    assert evaluate("- (1 + 2)") == -3
    assert evaluate("2 - -3") == 5
    assert evaluate("1 / 3 * 3") == pytest.approx(1.0)
    assert evaluate(".5 + 3.") == 3.5
    assert evaluate("6 ÷ 3 × 4 − 1") == 7


def test_literals_are_reported_in_order_with_their_kind():
    result = parse_and_evaluate("(3 + 5.5) × 2 - 007")
    assert result.literals == (3, 5.5, 2, 7)
    assert [type(n) for n in result.literals] == [int, float, int, int]
    assert result.value == 10.0


@pytest.mark.parametrize("text", [
    "", "   ", "1 2", "(1 + 2", "1 + 2)", "()", "+1", "1 +", "* 2", "2 ** 3", "9**9**9", "2 ^ 3", "abs(1)",
    "__import__('os').system('echo hi')", "x + 1", "a.b", "1e5", "1E5", "0x10", "1_000", "[1]", "1;2", "1 = 1",
    "3 // 2", "3 % 2", "１ + 2", "٣ + 1", "1 + 2\x00", "lambda: 1", "'1' + '2'", "1..2", "1.2.3",
])
def test_rejects_anything_but_arithmetic(text):
    with pytest.raises(ParseError):
        evaluate(text)


@pytest.mark.parametrize("text", ["1 / 0", "1 / (2 - 2)", "5 / 0.0", "1 / (0.5 - .5) + 3"])
def test_division_by_zero_is_invalid(text):
    with pytest.raises(ParseError, match="division by zero"):
        evaluate(text)


def test_nesting_is_bounded():
    ok = "(" * MAX_NESTING_DEPTH + "1" + ")" * MAX_NESTING_DEPTH
    assert evaluate(ok) == 1
    too_deep = "(" * (MAX_NESTING_DEPTH + 1) + "1" + ")" * (MAX_NESTING_DEPTH + 1)
    with pytest.raises(ParseError, match="nesting"):
        evaluate(too_deep)
    with pytest.raises(ParseError, match="nesting"):
        evaluate("-" * (MAX_NESTING_DEPTH + 1) + "1")
    assert evaluate("-" * MAX_NESTING_DEPTH + "1") == 1  # an even number of minus signs


def test_length_and_magnitude_are_bounded():
    at_limit = "1+" * (MAX_EXPRESSION_CHARS // 2 - 1) + "1"
    assert len(at_limit) <= MAX_EXPRESSION_CHARS and evaluate(at_limit) == MAX_EXPRESSION_CHARS // 2
    with pytest.raises(ParseError, match="characters"):
        evaluate("1" + "+1" * MAX_EXPRESSION_CHARS)
    with pytest.raises(ParseError, match="characters"):
        evaluate("9" * 40)  # a literal with more digits than allowed
    with pytest.raises(ParseError, match="magnitude"):
        evaluate("*".join(["10000000000"] * 4))  # 1e40
    with pytest.raises(ParseError, match="magnitude"):
        evaluate("1 / 0.0000000001 / 0.0000000001 / 0.0000000001 / 0.0000000001")


def test_not_a_string_is_a_parse_error():
    with pytest.raises(ParseError):
        evaluate(None)  # type: ignore[arg-type]


def test_hostile_inputs_are_cheap():
    hostile = ["(" * 5000 + "1" + ")" * 5000, "9" * 10_000, "1+" * 5000 + "1", "-" * 10_000 + "1",
               "9**9**9" * 1000, "(" * 31 + "9*" * 200 + "9" + ")" * 31]
    start = time.perf_counter()
    for text in hostile:
        with pytest.raises(ParseError):
            evaluate(text)
    assert time.perf_counter() - start < 0.5
