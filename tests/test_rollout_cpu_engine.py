"""The CPU rollout engine against an independent HF transformers model (weights, log-probs, greedy, seeding)."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3MoeConfig

from mppo.rollout import RolloutStateError, SamplingParams, cpu_decode
from mppo.rollout.cpu_engine import CPURolloutEngine
from mppo.rollout.cpu_attention import MIN_QUERIES, OWN_BLOCK, value_width
from mppo.rollout.cpu_model import MIN_ROWS, silu

VOCAB = 500


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


@pytest.fixture(autouse=True)
def single_thread():
    """Bitwise batch invariance is claimed for single-threaded torch (see mppo/rollout/cpu_model.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def source():
    """An HF model with random weights, scaled up so the next-token distributions are far from uniform."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(tiny_qwen2_config(initializer_range=0.2), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))] for _ in range(10)]


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    """A Qwen3-MoE (4 experts, top-2, norm_topk_prob; layer 1 dense via mlp_only_layers, head_dim 24)."""
    with torch.random.fork_rng():
        torch.manual_seed(77)
        config = Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
            tie_word_embeddings=False, initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("moe") / "model"
    model.save_pretrained(path, safe_serialization=True)
    _CHECKPOINT_STATE[id(model)] = load_file(str(path / "model.safetensors"))  # one tensor per expert weight
    return model


_CHECKPOINT_STATE: dict[int, dict[str, torch.Tensor]] = {}


def checkpoint_state(source) -> dict[str, torch.Tensor]:
    """The weights under HF checkpoint names (what mppo's exporter streams): transformers keeps a MoE model's
    experts fused in 3D parameters, its checkpoint has one tensor per expert and projection."""
    return _CHECKPOINT_STATE.get(id(source)) or source.state_dict()


def loaded_engine(source, config=None) -> CPURolloutEngine:
    engine = CPURolloutEngine(config or source.config)
    engine.update_weights(checkpoint_state(source).items())
    return engine


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def by_key(responses):
    return {(r.prompt_index, r.sample_index): r for r in responses}


SAMPLED = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=12, seed=11)


def test_weights_after_update_equal_the_source_bitwise(source):
    state = source.state_dict()
    names = list(state)
    buckets = [[(n, state[n]) for n in names[i : i + 5]] for i in range(0, len(names), 5)]
    stream = buckets[:-1] + [(n, t) for n, t in buckets[-1]]  # buckets and bare pairs mixed
    engine = CPURolloutEngine(source.config)
    engine.update_weights(stream)
    engine_state = engine.state_dict()
    assert set(engine_state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(as_bits(engine_state[name]), as_bits(tensor)), name
    assert engine_state["lm_head.weight"].data_ptr() == engine_state["model.embed_tokens.weight"].data_ptr()
    # The engine copies: changing the source afterwards does not change the engine.
    assert engine_state["model.norm.weight"].data_ptr() != state["model.norm.weight"].data_ptr()


def test_moe_weights_arrive_per_expert_into_the_fused_parameters(moe_source):
    """Each checkpoint tensor of an expert lands in its slice of transformers' fused [E, ...] parameters, bitwise;
    a stream without one expert's weight is refused; release and resume keep the per-expert names working."""
    state = checkpoint_state(moe_source)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in state and "model.layers.1.mlp.gate_proj.weight" in state
    engine = loaded_engine(moe_source)
    engine_state = engine.state_dict()
    assert set(engine_state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(as_bits(engine_state[name]), as_bits(tensor)), name
    fused = dict(moe_source.named_parameters())
    for name, param in engine._model.named_parameters():  # the fused parameters equal transformers' own
        assert torch.equal(param, fused[name]), name
    missing = "model.layers.2.mlp.experts.1.down_proj.weight"
    with pytest.raises(KeyError, match=f"lacked 1 of the model's weights.*{missing}"):
        CPURolloutEngine(moe_source.config).update_weights([(n, t) for n, t in state.items() if n != missing])
    engine.release()
    engine.update_weights(state.items())
    engine.resume()
    assert all(torch.equal(engine.state_dict()[n], t) for n, t in state.items())


def test_update_weights_rejects_bad_streams(source):
    state = source.state_dict()
    engine = CPURolloutEngine(source.config)
    with pytest.raises(KeyError, match="unknown weight 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(3))])
    with pytest.raises(KeyError, match="lacked 1 of the model's weights.*model.norm.weight"):
        engine.update_weights([(n, t) for n, t in state.items() if n != "model.norm.weight"])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="sent twice"):
        engine.update_weights([("model.norm.weight", state["model.norm.weight"])] * 2)
    tied_wrong = dict(state)
    tied_wrong["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="tied"):
        engine.update_weights(tied_wrong.items())
    with pytest.raises(RolloutStateError, match="update_weights"):  # a failed update leaves no usable weights
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), step=0)
    untied = dict(state)
    del untied["lm_head.weight"]  # tied aliases are optional: SGLang drops lm_head.weight when tied too
    engine.update_weights(untied.items())
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), step=0)


@pytest.mark.parametrize("model", ["source", "moe_source"])
def test_rollout_log_probs_equal_hf_recompute(model, prompts, request):
    source = request.getfixturevalue(model)
    engine = loaded_engine(source)
    for sampling, temperature in [(SAMPLED, 0.7), (SamplingParams(n=1, do_sample=False, max_new_tokens=12), 1.0)]:
        responses = engine.generate(prompts, sampling, step=3)
        assert len(responses) == len(prompts) * sampling.n
        worst = 0.0
        for r in responses:
            ids = torch.tensor([prompts[r.prompt_index] + r.token_ids])
            with torch.no_grad():
                logits = source(ids).logits[0].float()
            start = len(prompts[r.prompt_index]) - 1
            reference = torch.log_softmax(logits[start:-1] / temperature, dim=-1)
            reference = reference.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            worst = max(worst, (reference - torch.tensor(r.log_probs)).abs().max().item())
        assert worst < 1e-5, f"temperature {temperature}: max |rollout - HF recompute| = {worst:.2e}"


def test_sampled_tokens_respect_top_k_and_top_p(source, prompts):
    engine = loaded_engine(source)
    sampling = SamplingParams(n=4, temperature=1.3, top_k=3, top_p=0.8, max_new_tokens=8, seed=5)
    for r in engine.generate(prompts, sampling, step=0):
        ids = torch.tensor([prompts[r.prompt_index] + r.token_ids])
        with torch.no_grad():
            logits = source(ids).logits[0, len(prompts[r.prompt_index]) - 1 : -1]
        probs = torch.softmax(logits / 1.3, dim=-1)
        for position, token in enumerate(r.token_ids):
            row = probs[position]
            rank = int((row > row[token]).sum())
            assert rank < 3, "sampled outside the top-k"
            assert row[row > row[token]].sum() <= 0.8 + 1e-6, "sampled outside the nucleus"


def test_same_seed_same_rollouts_across_batch_compositions_and_dp_splits(source, prompts):
    engine = loaded_engine(source)
    together = by_key(engine.generate(prompts, SAMPLED, step=4))
    compositions = {
        "one by one": [r for i, p in enumerate(prompts) for r in engine.generate([p], SAMPLED, step=4, prompt_offsets=[i])],
        "reversed": engine.generate(prompts[::-1], SAMPLED, step=4, prompt_offsets=list(range(len(prompts)))[::-1]),
    }
    # DP2: two engine instances (two "ranks"), each with its half of the global prompt list.
    half = len(prompts) // 2
    rank0, rank1 = loaded_engine(source), loaded_engine(source)
    compositions["DP2"] = rank0.generate(prompts[:half], SAMPLED, step=4) + rank1.generate(
        prompts[half:], SAMPLED, step=4, prompt_offsets=list(range(half, len(prompts)))
    )
    for label, responses in compositions.items():
        got = by_key(responses)
        assert set(got) == set(together), label
        for key, reference in together.items():
            assert got[key].token_ids == reference.token_ids, (label, key)
            assert got[key].log_probs == reference.log_probs, (label, key)  # bitwise, single-threaded
            assert got[key].finish_reason == reference.finish_reason, (label, key)


def test_premise_gemm_rows_do_not_depend_on_the_other_rows():
    """The engine's batch invariance rests on this property of the CPU BLAS (mppo/rollout/cpu_model.py)."""
    gen = torch.Generator().manual_seed(3)
    for k, n in [(64, 128), (128, 352), (352, 128), (64, VOCAB)]:
        weight = torch.randn(n, k, generator=gen)
        x = torch.randn(120, k, generator=gen)
        alone = torch.stack([F.linear(torch.cat([x[i : i + 1], x[:MIN_ROWS - 1]]), weight)[0] for i in range(120)])
        for rows in (MIN_ROWS, 17, 31, 32, 33, 64, 95, 120):
            assert torch.equal(as_bits(F.linear(x[:rows], weight)), as_bits(alone[:rows])), (k, n, rows)


def _at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t (same shape and strides order) starting `offset` elements into a fresh buffer."""
    buffer = torch.empty(offset + t.numel(), dtype=t.dtype)
    view = buffer[offset:].view(t.shape)
    view.copy_(t)
    return view


# The engine's batched products (mppo/rollout/cpu_attention.py), [rows x inner] @ [inner x cols]: prompt q @ k^T
# (queries = n x group, head_dim, padded length), prompt weights x values (queries, BLOCK, value width), own q @ k^T
# (>= MIN_QUERIES, head_dim, multiple of OWN_BLOCK), own weights x values; head_dim 4 to 64.
ENGINE_PRODUCTS = [(MIN_QUERIES, 16, 32), (16, 16, 160), (12, 16, 64), (16, 64, 96), (8, 4, 64), (MIN_QUERIES, 32, 17),
                   (16, 32, 17), (12, 32, 65), (8, 32, value_width(4)), (MIN_QUERIES, 16, OWN_BLOCK),
                   (MIN_QUERIES, 16, 3 * OWN_BLOCK), (7, 64, 2 * OWN_BLOCK), (MIN_QUERIES, 8, OWN_BLOCK),
                   (MIN_QUERIES, OWN_BLOCK, 17), (MIN_QUERIES, 3 * OWN_BLOCK, 17), (7, 2 * OWN_BLOCK, 65),
                   (MIN_QUERIES, OWN_BLOCK, value_width(8))]


@pytest.mark.parametrize("rows, inner, cols", ENGINE_PRODUCTS)
def test_premise_batched_products_do_not_depend_on_place_batch_or_key_count(rows, inner, cols):
    """Decode attention's batch invariance rests on these (mppo/rollout/cpu_attention.py): with >= MIN_QUERIES rows
    and >= 16 columns (measured here: fewer rows, or fewer than 12 columns, take kernels whose bits depend on
    the memory offset of the matrices), a product's bits do not depend on where its inputs and output lie in
    memory (a matrix's place in a batch), on transposed storage, or on the batch size; and q @ k^T's entries do
    not depend on how many key columns (padded prompt positions) follow."""
    gen = torch.Generator().manual_seed(rows * 1000 + inner * 10 + cols)
    a, b = torch.randn(1, rows, inner, generator=gen), torch.randn(1, inner, cols, generator=gen)
    reference = as_bits(torch.bmm(a, b))
    for offset in range(16):
        out = _at_offset(torch.empty(1, rows, cols), offset)
        torch.bmm(_at_offset(a, offset), _at_offset(b, (3 * offset) % 16), out=out)
        a_t = _at_offset(a.transpose(1, 2).contiguous(), offset).transpose(1, 2)  # column-major storage
        b_t = _at_offset(b.transpose(1, 2).contiguous(), offset).transpose(1, 2)
        for got in (out, torch.bmm(a_t, b), torch.bmm(a, b_t), torch.bmm(a_t, b_t)):
            assert torch.equal(as_bits(got), reference), offset
    many_a, many_b = torch.randn(40, rows, inner, generator=gen), torch.randn(40, inner, cols, generator=gen)
    alone = torch.cat([torch.bmm(many_a[i : i + 1], many_b[i : i + 1]) for i in range(40)])
    for batch in (2, 3, 17, 40):
        assert torch.equal(as_bits(torch.bmm(many_a[:batch], many_b[:batch])), as_bits(alone[:batch])), batch
    keys = torch.randn(1, 512, inner, generator=gen)
    first = as_bits(torch.bmm(a, keys[:, :32].transpose(1, 2)))
    for length in (64, 96, 160, 512):
        assert torch.equal(as_bits(torch.bmm(a, keys[:, :length].transpose(1, 2))[..., :32]), first), length


def test_premise_elementwise_ops_do_not_depend_on_an_elements_position():
    """exp, log, cos and the engine's silu give an element the same bits in a tensor of any length and offset
    (torch's own silu does not: its scalar tail code differs, see mppo/rollout/cpu_model.py)."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4)) * 6
    for name, op in {"exp": torch.exp, "log": lambda t: torch.log(t.abs() + 1e-3), "cos": torch.cos,
                     "silu": silu, "exp64": lambda t: torch.exp(t.double())}.items():
        whole = op(x)
        for start, length in [(0, 1), (5, 7), (31, 33), (100, 15), (1000, 63), (2999, 1), (64, 2000)]:
            part = op(x[start : start + length].clone())
            assert torch.equal(part, whole[start : start + length]), (name, start, length)
    assert torch.allclose(silu(x), F.silu(x), rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def odd_source():
    """Widths that are no multiple of the vector length (intermediate 100, 3 query heads per KV head)."""
    with torch.random.fork_rng():
        torch.manual_seed(99)
        config = tiny_qwen2_config(initializer_range=0.2, hidden_size=48, intermediate_size=100,
                                   num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mha_source():
    """One query head per KV head (group 1: fewer queries than MIN_QUERIES per slot), head_dim 16."""
    with torch.random.fork_rng():
        torch.manual_seed(98)
        config = tiny_qwen2_config(initializer_range=0.2, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=2)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model, n", [("source", 4), ("odd_source", 4), ("mha_source", 3), ("mha_source", 1),
                                      ("moe_source", 3)])
def test_bitwise_invariance_with_long_prompts_stops_compaction_and_threads(model, n, request, monkeypatch):
    """Prompts over several attention blocks, samples stopping at different steps (so batches compact at
    different times in different compositions), other prompts around them, DP splits and worker threads."""
    source = request.getfixturevalue(model)
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 100))] for _ in range(9)]
    prompts += [[3], [4, 5], [6, 7, 8]]  # prefill of fewer than 4 rows, at different offsets in the packed batch
    engine = loaded_engine(source)
    free = engine.generate(prompts, SamplingParams(n=n, temperature=1.2, max_new_tokens=40, seed=2), step=1)
    counts = torch.bincount(torch.tensor([t for r in free for t in r.token_ids]), minlength=VOCAB)
    stop = counts.argsort(descending=True)[:6].tolist()  # the most frequent tokens: most samples stop early
    sampling = SamplingParams(n=n, temperature=1.2, top_p=0.95, max_new_tokens=40, seed=2, stop_token_ids=stop)

    compactions = []
    real_compact = cpu_decode._compact
    monkeypatch.setattr(cpu_decode, "_compact", lambda *a: compactions.append(1) or real_compact(*a))
    together = by_key(engine.generate(prompts, sampling, step=1))
    reasons = [r.finish_reason for r in together.values()]
    assert 0 < reasons.count("stop") < len(reasons) and len({len(r.token_ids) for r in together.values()}) > 5
    assert compactions, "the batch never compacted: the test does not cover it"

    others = [[rng.randrange(VOCAB) for _ in range(150)], [7]]
    half = len(prompts) // 2
    compositions = {
        "one by one": [r for i, p in enumerate(prompts)
                       for r in engine.generate([p], sampling, step=1, prompt_offsets=[i])],
        "reversed": engine.generate(prompts[::-1], sampling, step=1, prompt_offsets=list(range(len(prompts)))[::-1]),
        "with a longer prompt and a one-token prompt": engine.generate(
            prompts[:half] + others + prompts[half:], sampling, step=1,
            prompt_offsets=list(range(half)) + [100, 101] + list(range(half, len(prompts)))),
        "DP2": engine.generate(prompts[:half], sampling, step=1) + loaded_engine(source).generate(
            prompts[half:], sampling, step=1, prompt_offsets=list(range(half, len(prompts)))),
    }
    torch.set_num_threads(2)  # two workers, each on its share of the prompts (mppo/rollout/cpu_decode.py)
    compositions["2 threads"] = engine.generate(prompts, sampling, step=1)
    torch.set_num_threads(1)
    for label, responses in compositions.items():
        got = by_key(responses)
        for key, reference in together.items():
            assert got[key].token_ids == reference.token_ids, (label, key)
            assert got[key].log_probs == reference.log_probs, (label, key)  # bitwise
            assert got[key].finish_reason == reference.finish_reason, (label, key)


WORKER_THREADS_SCRIPT = """
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from mppo.rollout import SamplingParams, cpu_decode
from mppo.rollout.cpu_engine import CPURolloutEngine

seen = []
real = cpu_decode.generate_group
cpu_decode.generate_group = lambda *a: seen.append(torch.get_num_threads()) or real(*a)
config = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
engine = CPURolloutEngine(config)
engine.update_weights(AutoModelForCausalLM.from_config(config).state_dict().items())
torch.set_num_threads(2)
for prompts in ([[1, 2, 3]], [[1, 2], [3, 4, 5], [6]]):
    engine.generate(prompts, SamplingParams(n=2, max_new_tokens=3), step=0)
print(seen, torch.get_num_threads())
"""


def test_generation_workers_run_single_threaded_kernels(tmp_path):
    """With k torch threads the engine runs k workers, each with ONE-threaded kernels (multi-threaded kernels
    break bitwise invariance), also in threads that start with OpenMP's default of all cores, and also when
    there is a single prompt (one worker)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", WORKER_THREADS_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[1, 1, 1] 2"  # 1 worker, then 2; the caller's setting is restored


def test_seeds_steps_and_samples_give_different_rollouts(source, prompts):
    engine = loaded_engine(source)

    def tokens(sampling, step):
        return [r.token_ids for r in engine.generate(prompts, sampling, step=step)]

    base = tokens(SAMPLED, 0)
    assert tokens(SAMPLED, 0) == base
    assert tokens(SamplingParams(**{**SAMPLED.__dict__, "seed": 12}), 0) != base
    assert tokens(SAMPLED, 1) != base
    per_prompt = [base[i : i + SAMPLED.n] for i in range(0, len(base), SAMPLED.n)]
    assert any(len({tuple(s) for s in samples}) > 1 for samples in per_prompt), "the n samples of a prompt differ"


@pytest.mark.parametrize("model", ["source", "moe_source"])
def test_greedy_equals_hf_generate(model, prompts, request):
    source = request.getfixturevalue(model)
    engine = loaded_engine(source)
    for sampling in [SamplingParams(do_sample=False, max_new_tokens=10), SamplingParams(temperature=0.0, max_new_tokens=10)]:
        responses = engine.generate(prompts, sampling, step=0)
        for r in responses:
            ids = torch.tensor([prompts[r.prompt_index]])
            with torch.no_grad():
                hf = source.generate(
                    ids, attention_mask=torch.ones_like(ids),
                    generation_config=GenerationConfig(do_sample=False, max_new_tokens=10, min_new_tokens=10),
                )
            assert r.token_ids == hf[0, ids.shape[1] :].tolist()
            assert r.finish_reason == "length"


def test_stop_tokens_and_length_limit(source, prompts):
    engine = loaded_engine(source)
    greedy = SamplingParams(do_sample=False, max_new_tokens=10)
    reference = engine.generate(prompts[:1], greedy, step=0)[0].token_ids
    stop_at = next(i for i in range(2, 10) if reference[i] not in reference[:i])
    stop_token = reference[stop_at]

    stopped = engine.generate(prompts[:1], SamplingParams(do_sample=False, max_new_tokens=10, stop_token_ids=[stop_token]), step=0)[0]
    assert stopped.token_ids == reference[: stop_at + 1] and stopped.finish_reason == "stop"
    assert len(stopped.log_probs) == stop_at + 1

    eos_engine = loaded_engine(source, tiny_qwen2_config(initializer_range=0.2, eos_token_id=stop_token))
    by_eos = eos_engine.generate(prompts[:1], greedy, step=0)[0]  # the config's eos stops too, as in SGLang
    assert by_eos.token_ids == reference[: stop_at + 1] and by_eos.finish_reason == "stop"

    for r in engine.generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=1), step=0):
        assert len(r.token_ids) == 3 and r.finish_reason == "length"

    # ignore_eos: neither the stop token nor the config's eos ends the sample; it is the unstopped greedy run
    fixed = SamplingParams(do_sample=False, max_new_tokens=10, stop_token_ids=[stop_token], ignore_eos=True)
    for runner in (engine, eos_engine):
        unstopped = runner.generate(prompts[:1], fixed, step=0)[0]
        assert unstopped.token_ids == reference and unstopped.finish_reason == "length"
        assert unstopped.token_ids[stop_at] == stop_token


def test_release_and_resume_round_trip(source, prompts):
    engine = loaded_engine(source)
    before = engine.generate(prompts, SAMPLED, step=2)
    engine.release()
    assert all(t.numel() == 0 for t in engine.state_dict().values()), "release() frees the weights"
    with pytest.raises(RolloutStateError):
        engine.generate(prompts, SAMPLED, step=2)
    with pytest.raises(RolloutStateError, match="update_weights"):
        engine.resume()
    engine.update_weights(source.state_dict().items())
    with pytest.raises(RolloutStateError, match="resume"):
        engine.generate(prompts, SAMPLED, step=2)
    engine.resume()
    engine.flush_cache()
    after = engine.generate(prompts, SAMPLED, step=2)
    assert [(r.token_ids, r.log_probs) for r in after] == [(r.token_ids, r.log_probs) for r in before]
    for name, tensor in source.state_dict().items():
        assert torch.equal(as_bits(engine.state_dict()[name]), as_bits(tensor)), name


def test_bad_generate_arguments(source):
    engine = loaded_engine(source)
    with pytest.raises(ValueError, match="global index of each prompt"):
        engine.generate([[1], [2]], SAMPLED, step=0, prompt_offsets=[0])
    with pytest.raises(ValueError, match="distinct"):
        engine.generate([[1], [2]], SAMPLED, step=0, prompt_offsets=[3, 3])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SAMPLED, step=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([[1] * 250], SAMPLED, step=0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[VOCAB]], SAMPLED, step=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    other_architecture = tiny_qwen2_config()
    other_architecture.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type"):
        CPURolloutEngine(other_architecture)
    with pytest.raises(ValueError, match="SiLU"):
        CPURolloutEngine(tiny_qwen2_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="sliding"):
        CPURolloutEngine(tiny_qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=0))
