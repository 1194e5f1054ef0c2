"""Multi-turn rollout with tools over any RolloutEngine (issue 16 item 4): `AgentLoop`, run by the rollout
factory's per-group generate (`mppo.rollout.factory.Rollout.generate`) when `rollout.multi_turn.enable` is set.

Each of the n samples of a prompt is one conversation. A turn generates until eos or the end of a hermes tool call
(`</tool_call>`); a turn ending in a call runs the call's tools (`mppo.rollout.tools`), and their results are
appended as tool turns rendered by the tokenizer's chat template (with the next assistant header), then the model
continues. Up to `max_assistant_turns` assistant turns; the whole response is cut at `max_response_length` tokens.

`</tool_call>` may be several tokens (SmolLM2's tokenizer has no such token): engines stop on token ids, so a turn
stops at the marker's LAST token, and when the turn's text does not end with the marker (that token ended
something else, e.g. the `>` of `<answer>`) the same turn simply continues (a further generate call).

The response is the concatenation of the turns; `loss_mask` is 1 on tokens the model generated and 0 on the tool
turns (veRL's multi-turn `response_mask` holes: they are in the context but in no loss, KL or entropy term), and
their log-probs are 0.

Random streams: every generate call of a conversation gets its own prompt offset, a function of the conversation's
global id (global prompt index * n + sample) and of how many calls it made before only, so a rollout is the same
whatever the split of prompts over rollout groups (as single-turn rollouts are).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mppo.config import MppoConfig
from mppo.rollout.base import RolloutEngine, RolloutResponse, SamplingParams
from mppo.rollout.tools import ToolCall, parse_tool_calls, run_tool_call

__all__ = ["AgentLoop", "ToolRunner", "build_agent_loop", "tool_turn_ids", "run_agent_loop"]

TOOL_CALL_END = "</tool_call>"
# Offsets of a conversation's successive generate calls are conv_id + k * _CALL_STRIDE (conv ids stay below it).
_CALL_STRIDE = 1 << 40

# Runs the parsed tool calls of one turn, returns one message per call (the factory runs them on a group's first
# rank and shares the texts, so every rank of an SGLang group continues the same conversation).
ToolRunner = Callable[[list[ToolCall]], list[str]]


def tool_turn_ids(tokenizer: Any, tool_texts: list[str]) -> list[int]:
    """Token ids that follow a turn ending in a tool call: the end of the assistant's message (the turn stopped at
    `</tool_call>`, before the template's end-of-message, e.g. `<|im_end|>\n`), the tool messages and the next
    assistant generation prompt, as the tokenizer's chat template renders them after a conversation."""
    user = [{"role": "user", "content": "q"}]
    base = user + [{"role": "assistant", "content": "a"}]
    opened = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + [{"role": "tool", "content": t} for t in tool_texts],
                                          add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier messages differently once tool messages follow; "
                         "multi-turn rollout needs a template that appends turns")
    # what the template writes after an assistant message's content (none if it cannot be told apart)
    closing = before[len(opened) + 1:] if before.startswith(opened + "a") else ""
    return tokenizer.encode(closing + after[len(before):], add_special_tokens=False)


def tool_call_stop_id(tokenizer: Any) -> int:
    """The token a turn stops at to look for a finished tool call: the last token of `</tool_call>`."""
    ids = tokenizer.encode(TOOL_CALL_END, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer encodes {TOOL_CALL_END!r} to no tokens")
    return ids[-1]


def _local_tools(max_chars: int, truncate_side: str, timeout_s: float,
                 max_memory_mb: int | None = 1024) -> ToolRunner:
    return lambda calls: [run_tool_call(call, timeout_s=timeout_s, max_chars=max_chars, truncate_side=truncate_side,
                                        max_memory_mb=max_memory_mb) for call in calls]


def run_agent_loop(engine: RolloutEngine, prompt_token_ids: list[list[int]], sampling: SamplingParams, *,
                   step: int, prompt_offsets: list[int], tokenizer: Any, max_assistant_turns: int,
                   max_response_length: int, tool_timeout_s: float, max_tool_response_length: int = 256,
                   tool_response_truncate_side: str = "middle",
                   run_tools: ToolRunner | None = None) -> list[RolloutResponse]:
    """`sampling.n` conversations per prompt, prompt-major (as `engine.generate` orders samples)."""
    run_tools = run_tools or _local_tools(max_tool_response_length, tool_response_truncate_side, tool_timeout_s)
    stop_id = tool_call_stop_id(tokenizer)
    n = sampling.n
    turn_sampling = replace(sampling, n=1, stop_token_ids=tuple(sorted({*sampling.stop_token_ids, stop_id})))
    eos_ids = set(sampling.stop_token_ids)
    convs = [{"prompt": p, "ids": [], "lps": [], "mask": [], "calls": 0, "turns": 0, "generates": 0,
              "turn_start": 0, "finish": "stop", "index": prompt_offsets[i], "sample": s,
              "conv_id": prompt_offsets[i] * n + s}
             for i, p in enumerate(prompt_token_ids) for s in range(n)]
    if convs and max(c["conv_id"] for c in convs) >= _CALL_STRIDE:
        raise ValueError(f"prompt offsets up to {max(prompt_offsets)} x n={n} exceed the agent loop's seed space")
    active = list(range(len(convs)))
    while active:
        budget = {c: max_response_length - len(convs[c]["ids"]) for c in active}
        # One batched generate for every active conversation, at the largest budget; each output is then cut at
        # its own budget (a sample's first k tokens do not depend on max_new_tokens: its random stream is its own).
        outputs = engine.generate([convs[c]["prompt"] + convs[c]["ids"] for c in active],
                                  replace(turn_sampling, max_new_tokens=max(budget.values())), step=step,
                                  prompt_offsets=[convs[c]["conv_id"] + convs[c]["generates"] * _CALL_STRIDE
                                                  for c in active])
        still, pending = [], []  # pending: (conversation, its parsed calls), run together below
        for c, out in zip(active, outputs):
            conv = convs[c]
            tokens, log_probs, finish = out.token_ids, out.log_probs, out.finish_reason
            if len(tokens) > budget[c]:
                tokens, log_probs, finish = tokens[:budget[c]], log_probs[:budget[c]], "length"
            conv["ids"] += tokens
            conv["lps"] += log_probs
            conv["mask"] += [1] * len(tokens)
            conv["generates"] += 1
            if finish == "length" or not tokens:
                conv["finish"] = finish
                continue
            if tokens[-1] in eos_ids:  # the model ended its answer
                conv["finish"] = "stop"
                continue
            turn_text = tokenizer.decode(conv["ids"][conv["turn_start"]:], skip_special_tokens=False)
            if len(conv["ids"]) >= max_response_length:  # no room for a tool turn or more of this one
                conv["finish"] = "length"
                continue
            if not turn_text.endswith(TOOL_CALL_END):  # stopped at a token that ended something else: go on
                still.append(c)
                continue
            conv["turns"] += 1
            if conv["turns"] >= max_assistant_turns:
                conv["finish"] = "stop"
                continue
            pending.append((c, parse_tool_calls(turn_text)))
        texts = run_tools([call for _, calls in pending for call in calls])
        for c, calls in pending:
            conv = convs[c]
            mine, texts = texts[:len(calls)], texts[len(calls):]
            conv["calls"] += len(calls)
            tool_ids = tool_turn_ids(tokenizer, mine or ["error: no tool call could be read from this turn"])
            room = max_response_length - len(conv["ids"])
            conv["ids"] += tool_ids[:room]
            conv["lps"] += [0.0] * min(room, len(tool_ids))
            conv["mask"] += [0] * min(room, len(tool_ids))
            conv["turn_start"] = len(conv["ids"])
            if len(tool_ids) >= room:
                conv["finish"] = "length"
                continue
            still.append(c)
        active = sorted(still)
    return [RolloutResponse(c["index"], c["sample"], c["ids"], c["lps"], c["finish"], loss_mask=c["mask"],
                            num_tool_calls=c["calls"]) for c in convs]


@dataclass(frozen=True)
class AgentLoop:
    """`actor_rollout_ref.rollout.multi_turn` of a run with its tokenizer: what the rollout factory runs per group
    instead of a plain `engine.generate` (the response length limit is `sampling.max_new_tokens`)."""

    tokenizer: Any
    max_assistant_turns: int | None  # None: as many as fit in the length limit
    tool_timeout_s: float
    max_tool_response_length: int
    tool_response_truncate_side: str
    tool_max_memory_mb: int | None = 1024

    def local_tools(self) -> ToolRunner:
        return _local_tools(self.max_tool_response_length, self.tool_response_truncate_side, self.tool_timeout_s,
                            self.tool_max_memory_mb)

    def generate(self, engine: RolloutEngine, prompt_token_ids: list[list[int]], sampling: SamplingParams, *,
                 step: int, prompt_offsets: list[int], run_tools: ToolRunner | None = None) -> list[RolloutResponse]:
        limit = sampling.max_new_tokens
        return run_agent_loop(engine, prompt_token_ids, sampling, step=step, prompt_offsets=prompt_offsets,
                              tokenizer=self.tokenizer, max_assistant_turns=self.max_assistant_turns or limit,
                              max_response_length=limit, tool_timeout_s=self.tool_timeout_s,
                              max_tool_response_length=self.max_tool_response_length,
                              tool_response_truncate_side=self.tool_response_truncate_side,
                              run_tools=run_tools or self.local_tools())


def build_agent_loop(cfg: MppoConfig, tokenizer: Any) -> AgentLoop | None:
    """The run's AgentLoop (None when multi_turn is off); mppo.preflight.check_tokenizer has checked that the
    tokenizer's chat template renders tool turns."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return None
    return AgentLoop(tokenizer, mt.max_assistant_turns, mt.tool_timeout_s, mt.max_tool_response_length,
                     mt.tool_response_truncate_side, mt.tool_max_memory_mb)
