"""Per-sample seeding, counter-based uniforms and the inverse-CDF token choice, against naive references and
sampling statistics."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from mppo.rollout import SamplingParams, iter_weight_buckets, sample_seed, seeding
from mppo.rollout.sampling import choose_tokens, counter_uniforms, filter_top_k_top_p


def test_sample_seed_is_stable_across_processes_and_sensitive_to_each_part():
    cases = [(0, 0, 0, 0), (1, 2, 3, 4), (-5, 10**6, 2**40, 7)]
    # seeding.py has no dependencies: load the file alone so the subprocesses need not import torch.
    code = (
        "import importlib.util as u; "
        f"s = u.spec_from_file_location('seeding', {seeding.__file__!r}); m = u.module_from_spec(s); "
        "s.loader.exec_module(m); "
        f"print([m.sample_seed(*c) for c in {cases!r}])"
    )
    seen = set()
    for hash_seed in ("1", "2"):  # Python's hash() would differ between these processes
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.add(out.stdout.strip())
    assert seen == {str([sample_seed(*c) for c in cases])}
    base = (3, 5, 7, 9)
    seeds = {sample_seed(*base)}
    for i in range(4):
        changed = list(base)
        changed[i] += 1
        seeds.add(sample_seed(*changed))
    assert len(seeds) == 5
    assert all(0 <= s < 2**63 for s in seeds)


def naive_allowed(probs: list[float], top_k: int, top_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for rank, token in enumerate(order):
        if (top_k != -1 and rank >= top_k) or (rank > 0 and mass > top_p):
            break
        kept.add(token)
        mass += probs[token]
    return kept


def test_top_k_top_p_filter_matches_a_naive_loop():
    torch.manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(6, 30) * 2, dim=-1)
    for top_k, top_p in [(-1, 1.0), (5, 1.0), (-1, 0.5), (4, 0.7), (1, 0.9), (30, 0.99)]:
        filtered = filter_top_k_top_p(log_probs, top_k, top_p)
        for row in range(6):
            kept = {i for i in range(30) if filtered[row, i] > float("-inf")}
            assert kept == naive_allowed(log_probs[row].exp().tolist(), top_k, top_p), (top_k, top_p, row)
            assert torch.equal(filtered[row, sorted(kept)], log_probs[row, sorted(kept)])


def splitmix64(seed: int, count: int) -> list[int]:
    """Vigna's splitmix64.c next(), written out with Python integers (an independent reference)."""
    mask, state, out = (1 << 64) - 1, seed & ((1 << 64) - 1), []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_counter_uniforms_are_splitmix64_bit_for_bit():
    # published SplitMix64 outputs (seed 1234567; seed 0) pin the reference itself
    assert splitmix64(1234567, 3) == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert splitmix64(0, 1) == [0xE220A8397B1DCDAF]
    seeds = [0, 1, 1234567, 2**63 - 1, sample_seed(3, 1, 4, 1), 2**62 + 12345]
    positions = [0, 1, 2, 63, 500, 10**6]
    got = counter_uniforms(torch.tensor(seeds).repeat_interleave(len(positions)), torch.tensor(positions * len(seeds)))
    expected = [(splitmix64(s, p + 1)[-1] >> 11) * 2.0**-53 for s in seeds for p in positions]
    assert got.dtype == torch.float64 and got.tolist() == expected
    assert counter_uniforms(torch.tensor(seeds), 5).tolist() == counter_uniforms(torch.tensor(seeds),
                                                                                 torch.full((6,), 5)).tolist()


def test_counter_uniforms_are_uniform_and_independent_across_positions_and_seeds():
    seeds = torch.tensor([sample_seed(0, 0, p, s) for p in range(16) for s in range(8)])  # 128 samples
    u = counter_uniforms(seeds[:, None].expand(-1, 512), torch.arange(512)[None, :].expand(128, -1))
    flat = u.flatten().sort().values
    n = flat.numel()
    ks = (flat - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.63 / n**0.5, f"Kolmogorov-Smirnov distance {ks:.2e} (1% level {1.63 / n**0.5:.2e})"
    # pairs (u_t, u_t+1) and (sample i, sample i+1 at the same position) fill an 8 x 8 grid evenly (chi-square)
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        cells = torch.bincount(((a * 8).long() * 8 + (b * 8).long()).flatten(), minlength=64).double()
        expected = cells.sum() / 64
        chi2 = ((cells - expected) ** 2 / expected).sum().item()
        assert chi2 < 103.4, f"chi-square {chi2:.1f} over 63 degrees of freedom (0.1% level 103.4)"


def test_inverse_cdf_samples_the_filtered_renormalised_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, 0.9])
    sampling = SamplingParams(temperature=0.8, top_k=4, top_p=0.95)
    draws = 6000
    uniforms = counter_uniforms(torch.tensor([sample_seed(0, 0, i, 0) for i in range(draws)]), 0)
    tokens, log_probs = choose_tokens(logits.expand(draws, -1), sampling, uniforms)
    probs = torch.softmax(logits / 0.8, dim=-1)
    allowed = sorted(naive_allowed(probs.tolist(), 4, 0.95))
    target = torch.zeros(6)
    target[allowed] = probs[allowed] / probs[allowed].sum()
    counts = torch.bincount(tokens, minlength=6).double() / draws
    sigma = (target * (1 - target) / draws).sqrt()
    assert ((counts - target).abs() <= 4 * sigma + 1e-12).all(), (counts, target)
    # Returned log-probs are the UNFILTERED temperature-scaled ones (SGLang's semantics).
    assert torch.allclose(log_probs, torch.log(probs)[tokens], atol=1e-6)


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    probs = torch.tensor([0.1, 0.0, 0.2, 0.7])
    logits = probs.log()[None].expand(7, -1)
    u = torch.tensor([0.0, 0.0999, 0.1001, 0.2999, 0.3001, 0.9999, 1 - 2.0**-53], dtype=torch.float64)
    tokens, _ = choose_tokens(logits, SamplingParams(), u)
    assert tokens.tolist() == [0, 0, 2, 2, 3, 3, 3]  # never the zero-probability token 1


def test_a_rows_choice_depends_only_on_its_logits_and_uniform():
    torch.manual_seed(1)
    logits = torch.randn(5, 50)
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    uniforms = counter_uniforms(torch.arange(100, 105), 3)
    together, lp_together = choose_tokens(logits, sampling, uniforms)
    for i in range(5):
        alone, lp_alone = choose_tokens(logits[i : i + 1], sampling, uniforms[i : i + 1])
        assert alone.item() == together[i].item() and lp_alone.item() == lp_together[i].item()


def test_greedy_picks_the_argmax_with_temperature_one_log_probs():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 5.0]])
    for sampling in (SamplingParams(do_sample=False, temperature=0.5), SamplingParams(temperature=0.0)):
        tokens, log_probs = choose_tokens(logits, sampling, torch.rand(2, dtype=torch.float64))
        assert tokens.tolist() == [1, 0]  # first maximum on ties, as torch/HF argmax
        assert torch.allclose(log_probs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_weight_stream_normalisation():
    a, b, c = (("a", torch.zeros(1)), ("b", torch.ones(1)), ("c", torch.ones(2)))
    assert [[n for n, _ in bucket] for bucket in iter_weight_buckets([a, [b, c], (a,)])] == [["a"], ["b", "c"], ["a"]]
    try:
        list(iter_weight_buckets([[("a", 1.0)]]))
    except TypeError as exc:
        assert "(hf_name, tensor)" in str(exc)
    else:
        raise AssertionError("a non-tensor entry must be rejected")
