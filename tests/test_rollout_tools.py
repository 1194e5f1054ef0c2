"""The tools of multi-turn rollouts: hermes call parsing, the bounded calculator, and hostile calls contained in
time and memory (issue 16 item 4's tool part)."""
from __future__ import annotations

import time

from mppo.rollout.tools import ToolCall, parse_tool_calls, run_tool_call, truncate_text

RUN = dict(timeout_s=2.0, max_chars=256)


def call(text: str) -> str:
    (parsed,) = parse_tool_calls(text)
    return run_tool_call(parsed, **RUN)


def test_calculator_answers_a_hermes_call():
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5) - 7"}}' \
           '</tool_call>'
    assert call(text) == "20"
    assert call('<tool_call>{"name": "calculator", "arguments": {"expression": "7 / 2"}}</tool_call>') == "3.5"
    assert parse_tool_calls("no call here") == []
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call> x <tool_call>{"name": "b"}'
                           '</tool_call>')
    assert [c.name for c in two] == ["a", "b"]


def test_hostile_calls_become_tool_messages():
    start = time.monotonic()
    cases = {
        '{"name": "calculator", "arguments": {"expression": "9**9**9"}}': "error:",
        '{"name": "calculator", "arguments": {"expression": "' + "9" * 400 + '"}}': "error:",
        '{"name": "calculator", "arguments": {"expression": "1e308 * 1e308"}}': "error:",
        '{"name": "calculator", "arguments": {"expression": "' + "(" * 200 + "1" + ")" * 200 + '"}}': "error:",
        '{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}': "error:",
        '{"name": "calculator", "arguments": {"expression": 12}}': "error: expression must be a string",
        '{"name": "calculator", "arguments": {"expr": "1"}}': "error: TypeError",
        '{"name": "calculator", "arguments": "1+1"}': "error: arguments must be a JSON object",
        '{"name": "calculator", "arguments": {"expression": "1+1"': "error: the tool call is not valid JSON",
        '[1, 2]': "error: a tool call needs",
        '{"name": "rm", "arguments": {}}': "error: unknown tool 'rm'",
        "[" * 100000 + "]" * 100000: "error:",
    }
    for body, expected in cases.items():
        result = call(f"<tool_call>{body}</tool_call>")
        assert result.startswith(expected), (body[:60], result)
        assert len(result) <= 256 + len("...(truncated)...")
    assert time.monotonic() - start < 30


def test_a_hanging_or_huge_tool_is_cut():
    def hang(**_):
        while True:
            pass

    def huge(**_):
        return "x" * 10_000 + "END"

    def explode(**_):
        raise MemoryError("boom")

    registry = {"hang": hang, "huge": huge, "explode": explode}
    start = time.monotonic()
    assert run_tool_call(ToolCall("hang", {}), timeout_s=0.5, max_chars=256, registry=registry) == \
        "error: the tool did not finish within 0.5 s"
    assert time.monotonic() - start < 5
    text = run_tool_call(ToolCall("huge", {}), timeout_s=2, max_chars=100, registry=registry)
    assert text == "x" * 50 + "...(truncated)..." + "x" * 47 + "END"
    assert run_tool_call(ToolCall("explode", {}), **RUN, registry=registry) == "error: MemoryError: boom"


def test_truncation_sides_follow_verl():
    assert truncate_text("abcdefgh", 4, "left") == "(truncated)...efgh"
    assert truncate_text("abcdefgh", 4, "right") == "abcd...(truncated)"
    assert truncate_text("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert truncate_text("abc", 4, "middle") == "abc"


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_a_tool_that_allocates_without_bound_is_cut_in_memory():
    """The forked child's address space is capped (RLIMIT_AS) at what it inherits plus max_memory_mb: a tool that
    keeps allocating gets a MemoryError within the cap, long before the timeout, and a modest one still runs."""

    def hog(**_):
        chunks = []
        while True:
            chunks.append(bytearray(1 << 20))  # 1 MiB at a time, written: real memory, not overcommitted

    def modest(**_):
        return str(len(bytearray(64 << 20)))

    def one_big(**_):
        return str(len(bytearray(16 << 30)))  # 16 GiB at once

    registry = {"hog": hog, "modest": modest, "one_big": one_big}
    before = _rss_mb()
    start = time.monotonic()
    text = run_tool_call(ToolCall("hog", {}), timeout_s=30, max_chars=256, registry=registry, max_memory_mb=256)
    assert text.startswith("error: ") and "did not finish" not in text, text
    assert time.monotonic() - start < 10  # cut by the memory cap, not by the 30 s timeout
    assert run_tool_call(ToolCall("one_big", {}), timeout_s=30, max_chars=256, registry=registry,
                         max_memory_mb=256).startswith("error: MemoryError")
    assert run_tool_call(ToolCall("modest", {}), timeout_s=30, max_chars=256, registry=registry,
                         max_memory_mb=256) == str(64 << 20)
    assert _rss_mb() - before < 64  # the parent never held the tool's memory
