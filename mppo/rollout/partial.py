"""Partial rollouts (`async_training.partial_rollout`): a weight update interrupts the generation in flight, which
goes on on the new weights instead of finishing on the old ones (AReaL's interruptible generation, slime's partial
rollout).

The engine side of the separate placement (mppo.rollout.remote) generates through `generate_partial` with a
`WeightSwitch` over its message queue: the engine asks `pending()` after every decode step; when a new weight
version has arrived, the samples still running stop ("abort"), the engine loads the newest version, and each
interrupted sample goes on with its prompt and the tokens it has as the new prompt (a re-prefill: the KV cache of
the old weights is not reused) from the same place in its random stream. So every token is sampled from the
weights loaded when it was generated, and its rollout log-prob is theirs: rollout correction (TIS, IcePop,
rejection) sees the right probabilities without knowing about the interruption. Each response records the version
of every token (`token_versions`); its `policy_version` is the oldest one, which the staleness metrics count.

Where an interruption falls depends on when the trainer's update arrives, so two runs with partial rollouts are
not bitwise equal (a checkpoint still keeps the generation in flight with its token versions: nothing is lost or
regenerated on resume). The CPU engine checks after every decode step; SGLang's driver runs a watcher thread that
aborts every request on SGLang's event loop (its tokenizer manager's abort_request), and they come back with the
tokens they have.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from mppo.rollout.base import RolloutEngine, RolloutResponse, SamplingParams


@dataclass
class WeightSwitch:
    """What `generate_partial` needs from whoever receives the weights: whether a newer version has arrived, and a
    call that loads the newest (older ones still queued are dropped) and returns its version."""

    pending: Callable[[], bool]
    load_newest: Callable[[], int]
    version: int  # loaded now


def generate_partial(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingParams, *, step: int,
                     prompt_offsets: list[int], switch: WeightSwitch) -> list[RolloutResponse]:
    """engine.generate(prompts, ...), interrupted by every new weight version that arrives meanwhile; each
    response carries the version of each of its tokens. `switch.version` is the version loaded at the end."""
    # a version that came before this request started interrupts it at the first check: the engine (the driver of
    # an SGLang group) decides, so every rank of the group loads it at the same point
    responses = engine.generate(prompts, sampling, step=step, prompt_offsets=prompt_offsets,
                                interrupt=switch.pending)
    versions = [[switch.version] * len(r.token_ids) for r in responses]
    n = sampling.n
    while todo := [i for i, r in enumerate(responses) if r.finish_reason == "abort"]:
        switch.version = switch.load_newest()
        more = engine.continue_generation([prompts[i // n] for i in todo], [responses[i] for i in todo], sampling,
                                          step=step, interrupt=switch.pending)
        for i, added in zip(todo, more):
            before = responses[i]
            responses[i] = dataclasses.replace(before, token_ids=before.token_ids + added.token_ids,
                                               log_probs=before.log_probs + added.log_probs,
                                               finish_reason=added.finish_reason)
            versions[i] += [switch.version] * len(added.token_ids)
    return [dataclasses.replace(r, token_versions=v, policy_version=min(v, default=switch.version))
            for r, v in zip(responses, versions)]


__all__ = ["WeightSwitch", "generate_partial"]
