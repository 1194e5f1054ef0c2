"""Partial rollouts on the CPU engine (mppo.rollout.partial): a generation interrupted by new weights goes on on
them. References: the uninterrupted generation (the same weights reloaded must give the same tokens), and HF
transformers' forward, under the old weights for the tokens before the interruption and the new ones after."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from mppo.rollout import SamplingParams
from mppo.rollout.cpu_engine import CPURolloutEngine
from mppo.rollout.partial import WeightSwitch, generate_partial
from test_rollout_cpu_engine import VOCAB, single_thread, tiny_qwen2_config  # noqa: F401 (autouse fixture)

SAMPLED = SamplingParams(n=2, temperature=0.8, top_k=50, max_new_tokens=16, seed=5)


def model(seed: int):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_qwen2_config(initializer_range=0.2),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 9))] for _ in range(5)]


class ScriptedSwitch:
    """A weight update 'arrives' at the listed calls of pending(); loading it puts `versions[k]`'s weights in."""

    def __init__(self, engine, weights: list, at_calls: set[int]):
        self.engine, self.weights, self.at_calls, self.calls, self.loaded = engine, weights, at_calls, 0, 0

    def pending(self) -> bool:
        self.calls += 1
        return self.calls in self.at_calls and self.loaded + 1 < len(self.weights)

    def load_newest(self) -> int:
        self.loaded += 1
        self.engine.update_weights(self.weights[self.loaded].state_dict().items())
        return self.loaded

    def switch(self) -> WeightSwitch:
        return WeightSwitch(pending=self.pending, load_newest=self.load_newest, version=0)


def test_an_interruption_with_the_same_weights_changes_nothing(prompts):
    """Interrupted twice, with the same weights reloaded each time: the continued samples are the uninterrupted
    ones (same tokens: each goes on from its place in its random stream), log-probs to 1e-5 (a re-prefill)."""
    source = model(1)
    engine = CPURolloutEngine(source.config)
    engine.update_weights(source.state_dict().items())
    want = engine.generate(prompts, SAMPLED, step=2, prompt_offsets=list(range(10, 15)))
    scripted = ScriptedSwitch(engine, [source, source, source], at_calls={4, 9})
    got = generate_partial(engine, prompts, SAMPLED, step=2, prompt_offsets=list(range(10, 15)),
                           switch=scripted.switch())
    assert scripted.loaded == 2
    assert [(r.prompt_index, r.sample_index) for r in got] == [(r.prompt_index, r.sample_index) for r in want]
    interrupted = 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason != "abort"
        assert max(abs(a - b) for a, b in zip(g.log_probs, w.log_probs)) < 1e-5
        assert g.token_versions == sorted(g.token_versions) and g.policy_version == g.token_versions[0] == 0
        interrupted += len(set(g.token_versions)) > 1
    assert interrupted >= len(got) // 2  # most samples were still running at the first interruption


def test_tokens_after_the_interruption_come_from_the_new_weights(prompts):
    """Weights A, interrupted after 6 tokens (the 6th decode step's check), then weights B: tokens before are A's
    uninterrupted tokens, and every log-prob equals HF's under the weights that generated it (A before, B
    after)."""
    a, b = model(1), model(2)
    engine = CPURolloutEngine(a.config)
    engine.update_weights(a.state_dict().items())
    only_a = engine.generate(prompts, SAMPLED, step=0)
    scripted = ScriptedSwitch(engine, [a, b], at_calls={6})
    got = generate_partial(engine, prompts, SAMPLED, step=0, prompt_offsets=list(range(5)), switch=scripted.switch())
    worst, changed = 0.0, 0
    for g, w in zip(got, only_a):
        cut = g.token_versions.count(0)
        assert g.token_versions == [0] * cut + [1] * (len(g.token_ids) - cut)
        assert cut == min(6, len(w.token_ids)) and g.token_ids[:cut] == w.token_ids[:cut]
        changed += g.token_ids != w.token_ids
        prompt = prompts[g.prompt_index]
        ids = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            logits = {0: a(ids).logits[0], 1: b(ids).logits[0]}
        for j, (token, version) in enumerate(zip(g.token_ids, g.token_versions)):
            reference = torch.log_softmax(logits[version][len(prompt) - 1 + j] / SAMPLED.temperature, dim=-1)[token]
            worst = max(worst, abs(reference.item() - g.log_probs[j]))
    assert worst < 1e-5, worst
    assert changed > 0  # B's tail differs from what A would have generated


def test_continue_generation_refuses_what_is_not_interrupted(prompts):
    source = model(1)
    engine = CPURolloutEngine(source.config)
    engine.update_weights(source.state_dict().items())
    done = engine.generate(prompts[:1], SamplingParams(max_new_tokens=3), step=0)
    with pytest.raises(ValueError, match="finish reason 'abort'"):
        engine.continue_generation(prompts[:1], done, SamplingParams(max_new_tokens=3), step=0)


def test_the_engine_inbox_takes_the_newest_weights_ahead_of_their_turn():
    """Messages [generate a, weights 1, generate b, weights 2]: an interruption takes weights 2 (1 is dropped,
    superseded), the generate messages stay in order; a count says when a version waits."""
    from mppo.rollout.remote import _Inbox

    inbox = _Inbox()
    assert not inbox.weights_pending()
    for message in ({"op": "generate", "id": "a"}, {"op": "weights", "version": 1}, {"op": "generate", "id": "b"},
                    {"op": "weights", "version": 2}):
        inbox.put(message)
    assert inbox.get()["id"] == "a" and inbox.weights_pending()
    assert inbox.take_newest_weights()["version"] == 2 and not inbox.weights_pending()
    inbox.put({"op": "stop"})
    assert [inbox.get()["op"], inbox.get()["op"]] == ["generate", "stop"]
    # a rank whose driver saw a version first waits for it; a stop instead says so
    inbox.put({"op": "generate", "id": "c"})
    threading.Timer(0.2, inbox.put, args=({"op": "weights", "version": 3},)).start()
    assert inbox.take_newest_weights()["version"] == 3 and inbox.get()["id"] == "c"
    inbox.put({"op": "stop"})
    with pytest.raises(RuntimeError, match="stopped .* before the weight update"):
        inbox.take_newest_weights()


def test_token_versions_travel_with_the_packed_responses(prompts):
    """What the engine ranks send and a checkpoint keeps: the token versions, and the oldest as policy version."""
    from mppo.rollout.factory import pack_responses, unpack_responses

    source = model(1)
    engine = CPURolloutEngine(source.config)
    engine.update_weights(source.state_dict().items())
    scripted = ScriptedSwitch(engine, [source, source], at_calls={3})
    sent = generate_partial(engine, prompts, SAMPLED, step=0, prompt_offsets=list(range(5)), switch=scripted.switch())
    got = unpack_responses(pack_responses(sent))
    assert [r.token_versions for r in got] == [r.token_versions for r in sent]
    assert [r.policy_version for r in got] == [min(r.token_versions) for r in sent] == [0] * len(sent)
    assert [r.log_probs for r in got] == [r.log_probs for r in sent]
