"""A scripted policy as a real RolloutEngine (mppo's own engine interface, life cycle included): the text of each
assistant turn is a function of the conversation and of how many tool turns its context holds, and the engine
writes it token by token with the engine contract's stopping rules (the first stop token, inclusive, or
max_new_tokens), continuing a turn that an earlier call stopped inside. Used by the agent loop and trainer tests.
"""
from __future__ import annotations

from collections.abc import Callable

from mppo.rollout.base import RolloutEngine, RolloutResponse, SamplingParams

ASSISTANT_HEADER = "<|im_start|>assistant\n"
TOOL_HEADER = "<|im_start|>tool\n"
_CALL_STRIDE = 1 << 40  # the agent loop's offsets are conversation id + k * 2**40


def scripted_log_prob(token: int) -> float:
    """The log-prob the engine reports for a token (any fixed function: the trainer recomputes its own)."""
    return -(1 + token % 5) / 10


def _count(seq: list[int], sub: list[int]) -> tuple[int, int]:
    """(occurrences of `sub` in `seq`, end of the last one; -1 if none)."""
    count, last = 0, -1
    for i in range(len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            count, last = count + 1, i + len(sub)
    return count, last


class ScriptedEngine(RolloutEngine):
    """`policy(conversation_id, tool_turns_so_far) -> turn text`; a turn not ending in `</tool_call>` gets eos."""

    def __init__(self, tokenizer, policy: Callable[[int, int], str]):
        super().__init__()
        self.tok, self.policy = tokenizer, policy
        self.header = tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False)
        self.tool_header = tokenizer.encode(TOOL_HEADER, add_special_tokens=False)
        self.contexts: list[list[int]] = []

    def intended(self, conversation: int, tool_turns: int) -> list[int]:
        text = self.policy(conversation, tool_turns)
        ids = self.tok.encode(text, add_special_tokens=False)
        return ids if text.endswith("</tool_call>") else ids + [self.tok.eos_token_id]

    def _generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int,
                  prompt_indices: list[int]) -> list[RolloutResponse]:
        out = []
        for ids, index in zip(prompt_token_ids, prompt_indices):
            for s in range(sampling.n):
                self.contexts.append(list(ids))
                turns, _ = _count(ids, self.tool_header)
                _, start = _count(ids, self.header)
                assert start >= 0, "a context without an assistant header"
                partial, intended = ids[start:], self.intended((index % _CALL_STRIDE) * sampling.n + s, turns)
                assert intended[:len(partial)] == partial, "the context is not a prefix of the scripted turn"
                tokens, finish = [], "length"
                for t in intended[len(partial):]:
                    if len(tokens) == sampling.max_new_tokens:
                        break
                    tokens.append(t)
                    if t in sampling.stop_token_ids:
                        finish = "stop"
                        break
                else:
                    finish = "stop" if tokens and tokens[-1] in sampling.stop_token_ids else "length"
                out.append(RolloutResponse(index, s, tokens, [scripted_log_prob(t) for t in tokens], finish))
        return out

    def _load_weights(self, buckets) -> None:
        for _ in buckets:  # consume the exporter's stream: the script needs no weights
            pass

    def _release_memory(self) -> None:
        pass

    def _resume_weight_memory(self) -> None:
        pass

    def _resume_kv_cache(self) -> None:
        pass

    def _flush_cache(self) -> None:
        pass
