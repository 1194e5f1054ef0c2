"""The CPU engine's routed experts (routing replay, R3): for every token it ran, prompt and response, the top-k
experts of each MoE layer, against HF transformers' router on the same tokens; recording changes no token or
log-prob; a dense model is refused."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

from mppo.rollout import SamplingParams
from mppo.rollout.cpu_engine import CPURolloutEngine

VOCAB = 300
STOPS = tuple(range(30))  # stop tokens (a tenth of the vocabulary), so that some samples end early


@pytest.fixture(autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Qwen3-MoE: 4 experts, top-2, layer 1 dense (mlp_only_layers); the checkpoint (one tensor per expert)."""
    from safetensors.torch import load_file

    with torch.random.fork_rng():
        torch.manual_seed(5)
        config = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            tie_word_embeddings=False, initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("moe") / "model"
    model.save_pretrained(path, safe_serialization=True)
    return model, load_file(str(path / "model.safetensors"))


def engine_for(source, record: bool) -> CPURolloutEngine:
    model, state = source
    engine = CPURolloutEngine(model.config, record_routed_experts=record)
    engine.update_weights(list(state.items()))
    return engine


def hf_routes(model, tokens: list[int]) -> torch.Tensor:
    """[tokens, MoE layers, top_k]: top-k of softmax(router logits) of each MoE layer of HF's forward."""
    captured = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    return torch.stack([torch.softmax(lg.float(), -1).topk(k, dim=-1).indices for lg in captured], dim=1)


@pytest.mark.parametrize("threads", [1, 2])
def test_routes_are_hf_routers_choices_for_every_token_run(source, threads):
    torch.set_num_threads(threads)  # two workers generate shares of the prompts (mppo.rollout.cpu_decode)
    rng = random.Random(3)
    prompts = [[rng.randrange(30, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, stop_token_ids=STOPS, seed=11)
    responses = engine_for(source, record=True).generate(prompts, sampling, step=0)
    assert any(r.finish_reason == "stop" for r in responses) and any(r.finish_reason == "length" for r in responses)
    model, _ = source
    for r in responses:
        prompt = prompts[r.prompt_index]
        routes = r.routed_experts
        assert routes.dtype == torch.int32
        assert tuple(routes.shape) == (len(prompt) + len(r.token_ids) - 1, 2, 2)  # 2 MoE layers, top-2
        fed = prompt + r.token_ids[:-1]  # the last token is sampled, never run
        ref = hf_routes(model, fed)
        assert torch.equal(routes.sort(-1).values.long(), ref.sort(-1).values), (r.prompt_index, r.sample_index)


def test_recording_changes_no_token_or_log_prob(source):
    prompts = [[9, 10, 11], [40, 41], [100, 3, 5, 8, 200]]
    sampling = SamplingParams(n=2, max_new_tokens=8, stop_token_ids=STOPS, seed=2)
    plain = engine_for(source, record=False).generate(prompts, sampling, step=1)
    recorded = engine_for(source, record=True).generate(prompts, sampling, step=1)
    assert all(r.routed_experts is None for r in plain)
    assert [(r.token_ids, r.log_probs) for r in plain] == [(r.token_ids, r.log_probs) for r in recorded]


def test_dense_model_cannot_record_routes():
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="router_replay.mode=disabled"):
        CPURolloutEngine(config, record_routed_experts=True)


def test_routes_reach_the_micro_batches_at_their_tokens(source):
    """Engine -> rollout batch (left-padded prompts, routes by input_ids column) -> compacted micro-batch: row i's
    first prompt + response - 1 tokens carry HF's routes of those tokens, in order."""
    from mppo.data.loader import PromptBatch
    from mppo.trainer.rollout_batch import build_rollout_batch
    from mppo.workers.batching import ROUTES_KEY, make_micro_batch, validate_batch

    prompts = [[40, 41, 42, 43, 44], [50], [60, 61, 62]]
    n, width, max_response = 2, 6, 8
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    batch_prompts = PromptBatch(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                                raw_prompts=[""] * 3, data_sources=[""] * 3, ground_truths=[None] * 3,
                                extra_infos=[{}] * 3, indices=torch.arange(3))
    sampling = SamplingParams(n=n, max_new_tokens=max_response, stop_token_ids=STOPS, seed=4)
    responses = engine_for(source, record=True).generate(prompts, sampling, step=0)
    batch = build_rollout_batch(batch_prompts, responses, n=n, max_response_length=max_response, pad_token_id=0)
    assert batch[ROUTES_KEY].shape == (len(responses), width + max_response, 2, 2)
    validate_batch(batch)
    mb = make_micro_batch(batch, torch.arange(len(responses)))
    model, _ = source
    for row, r in enumerate(responses):
        fed = prompts[r.prompt_index] + r.token_ids[:-1]
        got = mb.data[ROUTES_KEY][row, :len(fed)]
        assert torch.equal(got.sort(-1).values.long(), hf_routes(model, fed).sort(-1).values), row
