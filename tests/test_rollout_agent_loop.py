"""The multi-turn agent loop's token layout with a scripted policy: the model's tokens in the loss mask, the tool
turns (the calculator's answer in the tokenizer's chat template) out of it, and the model sees the tool output."""
from __future__ import annotations

from mppo.data import build_local_tokenizer
from mppo.rollout.agent_loop import run_agent_loop, tool_turn_ids
from mppo.rollout.base import RolloutResponse, SamplingParams

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3 * 4"}}</tool_call>'
ANSWER = " <answer>14</answer>"


class ScriptedEngine:
    """Answers turn k of every conversation with script[k] (+ eos on the last script entry); records the contexts."""

    def __init__(self, tokenizer, script: list[str]):
        self.tok, self.script, self.contexts, self.calls = tokenizer, script, [], 0

    def generate(self, prompts, sampling, *, step, prompt_offsets=None):
        out = []
        for ids, offset in zip(prompts, prompt_offsets):
            self.contexts.append(list(ids))
            turn = ids.count(self.tok.convert_tokens_to_ids("</tool_call>"))  # turns so far = calls so far
            tokens = self.tok.encode(self.script[min(turn, len(self.script) - 1)], add_special_tokens=False)
            if turn >= len(self.script) - 1:
                tokens = tokens + [self.tok.eos_token_id]
            tokens = tokens[:sampling.max_new_tokens]
            stopped = tokens[-1] in sampling.stop_token_ids
            out.append(RolloutResponse(offset, 0, tokens, [-0.5] * len(tokens), "stop" if stopped else "length"))
        return out


def tokenizer(tmp_path):
    tok = build_local_tokenizer([CALL, ANSWER, "tool result 14"] * 20, 400, tmp_path / "tok")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def test_tool_turn_is_in_the_context_and_out_of_the_mask(tmp_path):
    tok = tokenizer(tmp_path)
    engine = ScriptedEngine(tok, [CALL, ANSWER])
    prompt = tok.encode("<|im_start|>user\nreach 14<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sampling = SamplingParams(n=2, max_new_tokens=64, stop_token_ids=(tok.eos_token_id,))
    responses = run_agent_loop(engine, [prompt], sampling, step=0, prompt_offsets=[5], tokenizer=tok,
                               max_assistant_turns=3, max_response_length=200, tool_timeout_s=2.0)
    assert len(responses) == 2 and [r.sample_index for r in responses] == [0, 1]
    call_ids = tok.encode(CALL, add_special_tokens=False)
    tool_ids = tool_turn_ids(tok, ["14"])
    answer_ids = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    assert "<|im_start|>tool\n14<|im_end|>" in tok.decode(tool_ids) and \
        tok.decode(tool_ids).endswith("<|im_start|>assistant\n")
    for r in responses:
        assert r.token_ids == call_ids + tool_ids + answer_ids
        assert r.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * len(answer_ids)
        assert r.log_probs == [-0.5] * len(call_ids) + [0.0] * len(tool_ids) + [-0.5] * len(answer_ids)
        assert r.num_tool_calls == 1 and r.finish_reason == "stop"
    # the second turn's context is the prompt, the call and the tool's answer
    assert prompt + call_ids + tool_ids in engine.contexts


def test_turn_limit_and_length_limit(tmp_path):
    tok = tokenizer(tmp_path)
    prompt = tok.encode("<|im_start|>user\nx<|im_end|>\n", add_special_tokens=False)
    sampling = SamplingParams(n=1, max_new_tokens=64, stop_token_ids=(tok.eos_token_id,))
    # a model that calls the tool forever stops after max_assistant_turns turns
    forever = ScriptedEngine(tok, [CALL] * 10 + [ANSWER])
    (r,) = run_agent_loop(forever, [prompt], sampling, step=0, prompt_offsets=[0], tokenizer=tok,
                          max_assistant_turns=2, max_response_length=1000, tool_timeout_s=2.0)
    assert r.num_tool_calls == 1 and sum(r.loss_mask) == 2 * len(tok.encode(CALL, add_special_tokens=False))
    # the response never exceeds max_response_length, tool turns included
    (r,) = run_agent_loop(ScriptedEngine(tok, [CALL] * 10), [prompt], sampling, step=0, prompt_offsets=[0],
                          tokenizer=tok, max_assistant_turns=10, max_response_length=50, tool_timeout_s=2.0)
    assert len(r.token_ids) == len(r.loss_mask) == len(r.log_probs) == 50 and r.finish_reason == "length"


def test_rollout_batch_keeps_tool_turns_attended_but_out_of_the_loss():
    import torch

    from mppo.data.loader import PromptBatch
    from mppo.trainer.rollout_batch import build_rollout_batch

    prompts = PromptBatch(input_ids=torch.tensor([[9, 5]]), attention_mask=torch.tensor([[1, 1]]),
                          position_ids=torch.tensor([[0, 1]]), raw_prompts=["p"], data_sources=["d"],
                          ground_truths=[None], extra_infos=[None], indices=torch.tensor([3]))
    response = RolloutResponse(0, 0, [1, 2, 7, 7, 3], [-0.1, -0.2, 0.0, 0.0, -0.3], "stop", loss_mask=[1, 1, 0, 0, 1],
                               num_tool_calls=1)
    b = build_rollout_batch(prompts, [response], n=1, max_response_length=6, pad_token_id=0)
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0]]
    assert b["rollout_log_probs"].tolist() == torch.tensor([[-0.1, -0.2, 0.0, 0.0, -0.3, 0.0]]).tolist()


def smol_like_tokenizer(tmp_path):
    """A tokenizer without a `</tool_call>` token (as SmolLM2's): the marker is several tokens, the last `>`."""
    return build_local_tokenizer([CALL, ANSWER, "tool result 14", "<b>x</b>"] * 20, 400, tmp_path / "tok")


def test_a_several_token_tool_call_end_is_found_and_other_stops_continue_the_turn(tmp_path):
    from scripted_engine import ScriptedEngine

    from mppo.rollout.agent_loop import tool_call_stop_id

    tok = smol_like_tokenizer(tmp_path)
    assert len(tok.encode("</tool_call>", add_special_tokens=False)) > 1
    stop = tool_call_stop_id(tok)
    first = "I will <b>check</b> it. " + CALL  # the `>` of <b> and </b> stop the engine inside the turn too
    engine = ScriptedEngine(tok, lambda conv, turns: first if turns == 0 else ANSWER)
    engine.update_weights([])  # the engine's life cycle: weights first (the script needs none)
    prompt = tok.encode("<|im_start|>user\nreach 14<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sampling = SamplingParams(n=1, max_new_tokens=64, stop_token_ids=(tok.eos_token_id,))
    (r,) = run_agent_loop(engine, [prompt], sampling, step=0, prompt_offsets=[0], tokenizer=tok,
                          max_assistant_turns=3, max_response_length=300, tool_timeout_s=2.0)
    first_ids = tok.encode(first, add_special_tokens=False)
    tool_ids = tool_turn_ids(tok, ["14"])
    answer_ids = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    assert r.token_ids == first_ids + tool_ids + answer_ids and r.num_tool_calls == 1
    assert r.loss_mask == [1] * len(first_ids) + [0] * len(tool_ids) + [1] * len(answer_ids)
    # the engine stopped at every `>` of the first turn before the call's own: one generate call each
    stops_in_first = sum(t == stop for t in first_ids)
    assert stops_in_first >= 3
    assert len(engine.contexts) == stops_in_first + 1 + (sum(t == stop for t in answer_ids))


def test_multi_turn_refuses_a_tokenizer_it_cannot_work_with(tmp_path):
    """mppo.preflight checks the run's tokenizer as soon as it is loaded; build_agent_loop trusts that check."""
    import pytest

    from dist_util import REPO
    from mppo.config import ConfigError, load_config
    from mppo.preflight import check_multi_turn_template
    from mppo.rollout.agent_loop import build_agent_loop

    tok = tokenizer(tmp_path)

    def cfg(*extra):
        return load_config(str(REPO / "configs" / "demo_cpu.yaml"),
                           ["actor_rollout_ref.rollout.multi_turn.enable=true", "trainer.n_gpus_per_node=1",
                            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", *extra], world_size=1)

    check_multi_turn_template(cfg(), tok)
    assert build_agent_loop(cfg(), tok).max_tool_response_length == 256
    assert build_agent_loop(cfg("actor_rollout_ref.rollout.multi_turn.enable=false"), tok) is None
    with pytest.raises(ConfigError, match="ignore_eos"):
        check_multi_turn_template(cfg("actor_rollout_ref.rollout.ignore_eos=true"), tok)
    template = tok.chat_template
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        check_multi_turn_template(cfg(), tok)
    # a template that renders only the last two messages cannot have turns appended
    tok.chat_template = "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ConfigError, match="cannot append a tool turn"):
        check_multi_turn_template(cfg(), tok)
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}" \
                        "{% endif %}{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match="cannot append a tool turn"):
        check_multi_turn_template(cfg(), tok)
    tok.chat_template = template


def test_responses_keep_their_loss_masks_through_the_factory_gather():
    from mppo.rollout.factory import pack_responses, unpack_responses

    agent = [RolloutResponse(4, 1, [5, 6, 7], [-0.25, 0.0, -1.5], "length", loss_mask=[1, 0, 1], num_tool_calls=2),
             RolloutResponse(9, 0, [8], [-0.125], "stop", loss_mask=[1], num_tool_calls=0)]
    assert unpack_responses(pack_responses(agent)) == agent
    plain = [RolloutResponse(3, 0, [1, 2], [-0.5, -0.75], "stop")]
    assert unpack_responses(pack_responses(plain)) == plain


def test_trainer_rejects_an_impossible_multi_turn_config_before_building_models():
    """One clear line at start-up (ignore_eos would never end a turn), not an error at step 1."""
    import pytest

    from mppo.config import ConfigError, load_config
    from mppo.trainer.fit import PPOTrainer

    import tempfile
    from pathlib import Path

    from dist_util import REPO
    from e2e_assets import make_assets, tiny_overrides

    with tempfile.TemporaryDirectory() as tmp:
        root = make_assets(Path(tmp) / "assets", train_size=8, test_size=4)
        cfg = load_config(str(REPO / "configs" / "demo_cpu.yaml"), tiny_overrides(root, Path(tmp) / "run", world=1, n=2,
                                                                  estimator="grpo") + [
            "critic.enable=false", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.ignore_eos=true"],
            world_size=1)
        with pytest.raises(ConfigError, match="multi_turn.enable=true with actor_rollout_ref.rollout.ignore_eos"):
            PPOTrainer(cfg)


def test_hostile_tool_calls_in_a_rollout_are_contained(tmp_path):
    """The scripted model writes hostile calls: each becomes a short tool message in its conversation, the rollout
    ends in bounded time, and every response stays within the length limit."""
    import time

    from scripted_engine import ScriptedEngine

    from mppo.rollout.tools import TOOL_REGISTRY, run_tool_call

    def spam(**_):
        return "7" * 10_000

    def hog(**_):
        chunks = []
        while True:
            chunks.append(bytearray(1 << 20))

    def hang(**_):
        while True:
            pass

    registry = {**TOOL_REGISTRY, "spam": spam, "hog": hog, "hang": hang}
    hostile = ['{"name": "calculator", "arguments": {"expression": "9**9**9"}}',
               '{"name": "calculator", "arguments": {"expression": "' + "9" * 5000 + ' * 9"}}',
               '{"name": "calculator", "arguments": {"expression": "1+1"',  # malformed JSON
               '{"name": "spam", "arguments": {}}', '{"name": "hog", "arguments": {}}',
               '{"name": "hang", "arguments": {}}']
    tok = tokenizer(tmp_path)
    engine = ScriptedEngine(tok, lambda conv, turns: f"<tool_call>{hostile[conv]}</tool_call>" if turns == 0
                            else ANSWER)
    engine.update_weights([])
    prompt = tok.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    seen = []

    def run_tools(calls):
        texts = [run_tool_call(c, timeout_s=1.0, max_chars=64, registry=registry, max_memory_mb=256) for c in calls]
        seen.extend(texts)
        return texts

    start = time.monotonic()
    responses = run_agent_loop(engine, [prompt] * len(hostile), SamplingParams(
        n=1, max_new_tokens=64, stop_token_ids=(tok.eos_token_id,)), step=0, prompt_offsets=list(range(len(hostile))),
        tokenizer=tok, max_assistant_turns=3, max_response_length=20_000, tool_timeout_s=1.0, run_tools=run_tools)
    assert time.monotonic() - start < 20
    assert len(seen) == len(hostile)
    assert seen[0].startswith("error:") and seen[1].startswith("error:") and seen[2].startswith("error: the tool call is not vali")
    assert seen[3] == "7" * 32 + "...(truncated)..." + "7" * 32
    assert seen[4].startswith("error:") and seen[5] == "error: the tool did not finish within 1 s"
    answer_ids = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    for r, text in zip(responses, seen):
        assert r.num_tool_calls == 1 and r.finish_reason == "stop"
        assert r.token_ids[-len(answer_ids):] == answer_ids  # the model went on after the tool message
        assert tool_turn_ids(tok, [text]) == [t for t, m in zip(r.token_ids, r.loss_mask) if m == 0]


def test_each_conversation_is_cut_at_its_own_budget_in_a_shared_generate(tmp_path):
    """Conversations of one generate call have different budgets left (a tool turn took some of one's): each is cut
    at its own, and a cut one ends "length" with the prefix of what it would have written."""
    from scripted_engine import ScriptedEngine

    tok = smol_like_tokenizer(tmp_path)
    long_answer = " " + "1 + " * 30 + "1"  # no stop token inside: generated past its budget, then cut
    engine = ScriptedEngine(tok, lambda conv, turns: (CALL if turns == 0 else long_answer) if conv == 0 else ANSWER)
    engine.update_weights([])
    prompt = tok.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    call_ids, tool_ids = tok.encode(CALL, add_special_tokens=False), tool_turn_ids(tok, ["14"])
    limit = len(call_ids) + len(tool_ids) + 5
    first, second = run_agent_loop(engine, [prompt, prompt], SamplingParams(
        n=1, max_new_tokens=limit, stop_token_ids=(tok.eos_token_id,)), step=0, prompt_offsets=[0, 1],
        tokenizer=tok, max_assistant_turns=3, max_response_length=limit, tool_timeout_s=2.0)
    long_ids = tok.encode(long_answer, add_special_tokens=False)
    assert first.token_ids == call_ids + tool_ids + long_ids[:5] and first.finish_reason == "length"
    assert first.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * 5
    answer_ids = tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]
    assert second.token_ids == answer_ids and second.finish_reason == "stop" and second.num_tool_calls == 0
