"""Tools a multi-turn rollout may call (issue 16 item 4, first part): the call format, the safe calculator, and
running a tool so that whatever it does becomes a tool message, never a crash or a hang.

- Call format: veRL's default `rollout.multi_turn.format=hermes`, i.e. the model writes
  `<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>`.
  Unlike veRL's parser (which logs and drops a malformed call), a call that is not valid JSON or lacks a name
  becomes an error result the model sees, so it can learn from it.
- `calculator`: the project's bounded arithmetic parser (`mppo.rewards.arith`, never `eval`): `9**9**9`,
  names, huge literals and deep nesting are parse errors.
- `run_tool_call`: runs the tool in the sandbox of `mppo.rollout.tool_sandbox` (its own session and PID and
  network namespaces, killed as a whole at `timeout_s`; RLIMIT_AS at what the fork inherits plus `max_memory_mb`,
  RLIMIT_NPROC / FSIZE / CPU; no inherited descriptors; an empty working directory; output through a bounded
  pipe); every exception becomes the tool's text; the text is cut to `max_chars` like veRL's
  `max_tool_response_length` / `tool_response_truncate_side`, inside the sandbox, so the trainer reads only that.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from mppo.rewards.arith import ParseError, evaluate
from mppo.rollout.tool_sandbox import SandboxLimits, run_sandboxed

__all__ = ["ToolCall", "TOOL_REGISTRY", "register_tool", "parse_tool_calls", "run_tool_call", "truncate_text",
           "calculator"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # set when the call could not be parsed: the error is the tool message


ToolFn = Callable[..., str]
TOOL_REGISTRY: dict[str, ToolFn] = {}


def register_tool(name: str) -> Callable[[ToolFn], ToolFn]:
    def decorator(fn: ToolFn) -> ToolFn:
        if name in TOOL_REGISTRY and TOOL_REGISTRY[name] is not fn:
            raise ValueError(f"tool {name!r} is already registered")
        TOOL_REGISTRY[name] = fn
        return fn
    return decorator


@register_tool("calculator")
def calculator(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / and parentheses), or why it has none."""
    if not isinstance(expression, str):
        return f"error: expression must be a string, got {type(expression).__name__}"
    try:
        value = evaluate(expression)
    except ParseError as err:
        return f"error: {err}"
    return str(int(value)) if float(value).is_integer() else repr(value)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The hermes-format tool calls in a model turn, in order (malformed ones as ToolCall(error=...))."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as err:
            calls.append(ToolCall("", {}, f"error: the tool call is not valid JSON ({str(err)[:80]})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall("", {}, 'error: a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], {}, "error: arguments must be a JSON object"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def truncate_text(text: str, max_chars: int, side: str = "middle") -> str:
    """veRL's tool-response cut: keep `max_chars` characters from the end (left), start (right) or both ends
    (middle), with a "(truncated)" marker."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_chars:]
    if side == "right":
        return text[:max_chars] + "...(truncated)"
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[-half:]


def run_tool_call(call: ToolCall, *, timeout_s: float, max_chars: int, truncate_side: str = "middle",
                  registry: dict[str, ToolFn] | None = None, max_memory_mb: int | None = 1024,
                  limits: SandboxLimits | None = None) -> str:
    """The tool message for `call`: its result, or an error text; never raises, returns within about timeout_s;
    the tool may allocate at most `max_memory_mb` MiB beyond what the fork inherits (None: no cap); `limits` sets
    the sandbox's other limits (processes, file size, CPU time; its memory_mb is replaced by max_memory_mb)."""
    registry = TOOL_REGISTRY if registry is None else registry
    if call.error:
        return truncate_text(call.error, max_chars, truncate_side)
    fn = registry.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name[:64]!r}; available: {', '.join(sorted(registry))}"
    limits = replace(limits or SandboxLimits(), memory_mb=max_memory_mb)
    arguments = call.arguments
    text = run_sandboxed(lambda: truncate_text(str(fn(**arguments)), max_chars, truncate_side), timeout_s=timeout_s,
                         limits=limits, max_bytes=4 * (max_chars + 32) + 512)  # UTF-8 of the cut text, or an error
    return truncate_text(text, max_chars, truncate_side)
