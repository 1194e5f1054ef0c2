"""A small, bounded arithmetic evaluator for model answers (no `eval`).

Grammar (usual precedence, left-associative binary operators):

    expression := term (("+" | "-") term)*
    term       := unary (("*" | "/") unary)*
    unary      := "-" unary | primary
    primary    := NUMBER | "(" expression ")"

NUMBER is an integer or decimal literal (`12`, `1.5`, `.5`, `3.`). `×`, `÷` and the unicode minus `−` are accepted
as `*`, `/` and `-`. Nothing else is: no `**`, no names, no calls, no attribute access. Model output is hostile
input, so the text length, the nesting depth and every value's magnitude are bounded; the evaluator does work
linear in the text length and never builds huge numbers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MAX_EXPRESSION_CHARS = 512
MAX_NESTING_DEPTH = 32
# Literal and intermediate magnitudes: far above any countdown/multiply answer, far below float overflow, and
# exact for integers up to 2**53 so integer arithmetic within the bound matches Python's.
MAX_LITERAL_CHARS = 24
MAX_MAGNITUDE = 1e30

_UNICODE_OPERATORS = {"×": "*", "÷": "/", "−": "-"}
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")  # ASCII digits only (re's \d takes any script's)
_OPERATORS = "+-*/()"


class ParseError(ValueError):
    """The text is not an arithmetic expression this evaluator accepts, or its value is undefined."""


@dataclass(frozen=True)
class ArithResult:
    value: float
    # The literals in order of appearance: int for integer literals, float for decimal ones. Countdown uses
    # them to check that each given number is used exactly once.
    literals: tuple[int | float, ...]


def _tokenize(text: str) -> list[tuple[str, int | float | None, int]]:
    """(kind, value, position) triples; kind is "num" or one of the operator characters."""
    tokens: list[tuple[str, int | float | None, int]] = []
    pos = 0
    while pos < len(text):
        char = text[pos]
        if char in " \t\n\r":
            pos += 1
            continue
        char = _UNICODE_OPERATORS.get(char, char)
        if char in _OPERATORS:
            tokens.append((char, None, pos))
            pos += 1
            continue
        match = _NUMBER.match(text, pos)
        if match is None:
            raise ParseError(f"unexpected character {text[pos]!r} at position {pos}; only numbers, + - * / "
                             "× ÷ and parentheses are allowed")
        literal = match.group(0)
        if len(literal) > MAX_LITERAL_CHARS:
            raise ParseError(f"number at position {pos} has {len(literal)} characters; the limit is "
                             f"{MAX_LITERAL_CHARS}")
        value: int | float = float(literal) if "." in literal else int(literal)
        if abs(value) > MAX_MAGNITUDE:
            raise ParseError(f"number at position {pos} exceeds the magnitude limit {MAX_MAGNITUDE:g}")
        tokens.append(("num", value, pos))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, int | float | None, int]], text_length: int) -> None:
        self.tokens = tokens
        self.index = 0
        self.depth = 0
        self.text_length = text_length
        self.literals: list[int | float] = []

    def peek(self) -> str | None:
        return self.tokens[self.index][0] if self.index < len(self.tokens) else None

    def position(self) -> int:
        return self.tokens[self.index][2] if self.index < len(self.tokens) else self.text_length

    def expect_end(self) -> None:
        if self.index < len(self.tokens):
            kind, _, pos = self.tokens[self.index]
            what = "a number" if kind == "num" else repr(kind)
            raise ParseError(f"unexpected {what} at position {pos}")

    def expression(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.tokens[self.index][0]
            self.index += 1
            right = self.term()
            value = _checked(value + right if op == "+" else value - right)
        return value

    def term(self) -> float:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.tokens[self.index][0]
            self.index += 1
            right = self.unary()
            if op == "*":
                value = _checked(value * right)
            elif right == 0:
                raise ParseError("division by zero")
            else:
                value = _checked(value / right)
        return value

    def unary(self) -> float:
        if self.peek() != "-":
            return self.primary()
        self.index += 1
        self._enter()
        value = -self.unary()
        self.depth -= 1
        return value

    def primary(self) -> float:
        kind = self.peek()
        if kind == "num":
            literal = self.tokens[self.index][1]
            assert literal is not None
            self.index += 1
            self.literals.append(literal)
            return float(literal)
        if kind == "(":
            self.index += 1
            self._enter()
            value = self.expression()
            if self.peek() != ")":
                raise ParseError(f"missing ')' at position {self.position()}")
            self.index += 1
            self.depth -= 1
            return value
        what = "end of expression" if kind is None else repr(kind)
        raise ParseError(f"expected a number or '(' at position {self.position()}, found {what}")

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING_DEPTH:
            raise ParseError(f"nesting deeper than {MAX_NESTING_DEPTH} levels")


def _checked(value: float) -> float:
    if not abs(value) <= MAX_MAGNITUDE:  # also catches nan
        raise ParseError(f"intermediate value exceeds the magnitude limit {MAX_MAGNITUDE:g}")
    return value


def parse_and_evaluate(text: str) -> ArithResult:
    """Evaluate `text`; return its value and its literals. Raises ParseError for anything not accepted."""
    if not isinstance(text, str):
        raise ParseError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ParseError(f"expression has {len(text)} characters; the limit is {MAX_EXPRESSION_CHARS}")
    parser = _Parser(_tokenize(text), len(text))
    value = parser.expression()
    parser.expect_end()
    return ArithResult(value=value, literals=tuple(parser.literals))


def evaluate(text: str) -> float:
    """The value of the arithmetic expression `text` (see module docstring); raises ParseError."""
    return parse_and_evaluate(text).value
