"""Benchmarks (mppo.bench.step/scaling/trl_compare) at tiny size, and the pieces their figures rest on: the
workers' padding counter, the token-budget grouping, the bench model's stop probability, the shared reward.

Not timing tests: the one launch checks that `mppo bench step` runs PPO and GRPO and that its token counts agree
with the trainer's own (every row passes once through the old-log-prob forward)."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mppo.bench import _trl_grpo, scaling, trl_compare
from mppo.workers.batching import TOKEN_COUNTER, make_micro_batches, split_by_tokens

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ grouping
def _all_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _all_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


@pytest.mark.parametrize("seed", range(6))
def test_token_budget_grouping_is_optimal_over_every_partition(seed):
    """Brute force over ALL set partitions (not only runs of sorted rows): none processes fewer tokens plus
    per-group overhead within the budget than split_by_tokens' grouping."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (7,), generator=g)
    budget, overhead = 80, 10

    def cost(groups) -> float:
        if any(len(grp) * max(int(lengths[i]) for i in grp) > budget for grp in groups):
            return math.inf
        return sum(len(grp) * max(int(lengths[i]) for i in grp) + overhead for grp in groups)

    groups = split_by_tokens(torch.arange(7), lengths, budget, overhead_tokens=overhead)
    got = [g.tolist() for g in groups]
    assert sorted(itertools.chain(*got)) == list(range(7))
    assert cost(got) == min(cost(p) for p in _all_partitions(list(range(7))))


def _wide_batch(rows: int, response_max: int, seed: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts (130-145 tokens) ++ right-padded responses with geometric lengths (mean ~T/2, cut at T)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(130, 146, (rows,), generator=g)
    u = torch.rand(rows, generator=g)
    resp_len = (torch.log1p(-u) / math.log1p(-2 / response_max)).ceil().clamp(1, response_max).long()
    width = 145 + response_max
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        mask[r, 145 - prompt_len[r]:145 + resp_len[r]] = 1
    ids = torch.randint(4, 100, (rows, width), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, 145:], "response_mask": mask[:, 145:].float()}


@pytest.mark.parametrize("rows, response_max, budget", [(32, 64, 2048), (64, 256, 4096), (256, 1024, 16384)])
def test_token_budget_keeps_padding_under_5_percent_for_wide_lengths(rows, response_max, budget):
    batch = _wide_batch(rows, response_max, seed=rows)
    dynamic = make_micro_batches(batch, torch.arange(rows), max_token_len=budget)
    by_count = make_micro_batches(batch, torch.arange(rows), micro_batch_size=4)
    real = int(batch["attention_mask"].sum())  # counted independently of the micro-batches
    for micro in (dynamic, by_count):
        assert sum(mb.real_tokens for mb in micro) == real
    processed = sum(mb.num_tokens for mb in dynamic)
    assert all(mb.num_tokens <= budget for mb in dynamic)
    assert 1 - real / processed < 0.05
    assert 1 - real / sum(mb.num_tokens for mb in by_count) > 0.10  # what the budget's sorting saves


# ------------------------------------------------------------------------------------------------ bench model
def test_raised_eos_probability_matches_the_target():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mppo.bench.assets import raise_eos

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    raise_eos(model, 0, 0.05)
    ids = torch.randint(4, 300, (2, 300), generator=torch.Generator().manual_seed(7))  # not the calibration probe
    with torch.no_grad():
        p = model(ids).logits.softmax(-1)[..., 0]
    assert 0.04 < p.mean().item() < 0.06 and p.min().item() > 0.02


# ------------------------------------------------------------------------------------------------ reward
def test_shared_reward_scores_the_response_only_and_loads_as_an_mppo_custom_fn():
    from mppo.rewards.registry import load_custom_reward_fn

    fn = load_custom_reward_fn(trl_compare.TRL_SCRIPT, "compute_score")
    prompt = "Using the numbers [1, 2, 3] ... Assistant: " + _trl_grpo.PROMPT_END
    assert fn("countdown", prompt + " 12 + 34<|endoftext|>", {}) == pytest.approx(4 / 16)
    assert fn("countdown", prompt + "no digits", {}) == 0.0
    assert _trl_grpo.trl_reward(["p"] * 2, ["1" * 40, "a1b2"]) == [1.0, pytest.approx(2 / 16)]
    with pytest.raises(ValueError, match="does not end with"):
        fn("countdown", "42 without the prompt", {})


def test_trl_compare_settings_are_a_valid_mppo_config(tmp_path):
    from mppo.config import load_config

    opts = trl_compare._parser().parse_args(["--nproc", "2"])
    spec = trl_compare.mppo_spec(opts, tmp_path, tmp_path / "run", seed=3)
    cfg = load_config(spec["config"], spec["overrides"], world_size=2)
    actor = cfg.actor_rollout_ref.actor
    assert (cfg.algorithm.adv_estimator, actor.use_kl_loss, cfg.algorithm.use_kl_in_reward) == ("grpo", False, False)
    assert (actor.optim.lr, actor.optim.weight_decay, actor.ppo_mini_batch_size) == (1e-3, 0.0, 8)
    assert cfg.trainer.seed == 3 and not cfg.data.shuffle
    assert not cfg.actor_rollout_ref.rollout.ignore_eos
    fixed = trl_compare.mppo_spec(trl_compare._parser().parse_args(["--fixed-length"]), tmp_path, tmp_path, seed=3)
    assert load_config(fixed["config"], fixed["overrides"], world_size=2).actor_rollout_ref.rollout.ignore_eos
    run = [{"seconds": 2.0, "tokens": 100, "reward": 0.1, "response_length": 5, "generation_seconds": 1.0,
            "response_tokens": 40},
           {"seconds": 1.0, "tokens": 300, "reward": 0.3, "response_length": 7, "generation_seconds": 0.25,
            "response_tokens": 50}]
    other = [{**s, "reward": s["reward"] + 0.2} for s in run]
    summary = trl_compare.side_summary([run, other], 1)
    assert summary["tokens_per_s"] == 300 and summary["tokens_per_s_all"] == pytest.approx(400 / 3)
    assert summary["generation_tokens_per_s"] == pytest.approx(200) and summary["update_tokens_per_s"] == 400
    assert (summary["median_generation_s"], summary["median_update_s"]) == (0.25, 0.75)
    assert (summary["reward_last"], summary["reward_last_min"], summary["reward_last_max"]) == pytest.approx(
        (0.4, 0.3, 0.5))
    assert "4.00x" in trl_compare.render(summary, {**summary, "tokens_per_s": 75.0}, 1)


def test_scaling_growth_exponents_and_table():
    pts = [{"batch": b, "seconds": {"gen": 0.5 * b ** 0.5, "update_actor": 0.1 * b, "step": 1.0}} for b in (4, 16)]
    k = scaling.growth(pts, "batch")
    assert k["gen"] == pytest.approx(0.5) and k["update_actor"] == pytest.approx(1.0) and k["step"] == 0.0


# ------------------------------------------------------------------------------------------------ the command
def test_bench_step_runs_ppo_and_counts_every_token(tmp_path):
    """PPO (GAE + critic) on one rank; GRPO's run is the MoE one below (one launch fewer, the same claims)."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "MPPO_BENCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mppo", "bench", "step", "--estimators", "gae", "--warmup", "0", "--steps", "1",
           "--repeats", "1", "--batch", "4", "--n", "2", "--response-length", "8", "--hidden", "32", "--layers", "2",
           "--token-budget", "1024", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for text in ("PPO (GAE + critic)", "update_critic", "tokens/s", "MFU", "padding, all phases"):
        assert text in proc.stdout
    assert_counts_every_token(json.loads(out.read_text()), "gae", {"actor/log_prob", "ref/log_prob", "critic/values",
                                                                   "critic/update", "actor/update"})


def assert_counts_every_token(result: dict, estimator: str, phases: set[str]) -> None:
    (measured,) = result["results"][estimator]["steps"]
    assert set(measured["padding"]) == phases
    # each row passes once through the old-log-prob forward: its real tokens are the trainer's token count
    assert measured["padding"]["actor/log_prob"]["real"] == measured["tokens"]
    for counts in measured["padding"].values():
        assert 0 < counts["real"] <= counts["processed"]
    summary = result["summaries"][estimator]
    assert summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1


def test_bench_generation_runs_both_sides_to_the_exact_length(tmp_path):
    out = tmp_path / "gen.json"
    env = {**os.environ, "MPPO_BENCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mppo", "bench", "generation", "--hidden", "32", "--layers", "1", "--prompts", "3",
           "--n", "2", "--length", "5", "--threads", "1,2", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "mppo/HF" in proc.stdout and "3 countdown prompts" in proc.stdout
    result = json.loads(out.read_text())
    for threads in ("1", "2"):
        for side in ("mppo", "hf"):
            (run,) = result["threads"][threads]["runs"][side]
            assert run["tokens"] == 3 * 2 * 5 and run["seconds"] > 0  # the bench also refuses a wrong count


def test_token_counter_is_reset_and_totals():
    TOKEN_COUNTER.reset()
    TOKEN_COUNTER.add("a", 3, 4)
    TOKEN_COUNTER.add("b", 5, 6)
    total = TOKEN_COUNTER.total()
    assert (total.real, total.processed, total.micro_batches) == (8, 10, 2)
    assert total.padding_fraction == pytest.approx(0.2)
    TOKEN_COUNTER.reset()
    assert TOKEN_COUNTER.phases == {}


def test_bench_step_runs_grpo_on_a_tiny_moe_at_ep2(tmp_path):
    """GRPO on a random Qwen3-MoE (4 experts, top-2) at EP2 over 2 ranks: the run completes, says what it ran,
    counts the model's parameters in full (each rank holds half of the experts) and every token of each phase."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "MPPO_BENCH_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "mppo", "bench", "step", "--estimators", "grpo", "--nproc", "2", "--experts", "4",
           "--ep", "2", "--warmup", "0", "--steps", "1", "--repeats", "1", "--batch", "4", "--n", "2",
           "--response-length", "8", "--hidden", "32", "--layers", "2", "--token-budget", "1024", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "random Qwen3-MoE (4 experts, top-2, EP2)" in proc.stdout and "GRPO" in proc.stdout
    result = json.loads(out.read_text())
    from safetensors import safe_open

    from mppo.models.vocab import padded_vocab_size

    (model_dir,) = (tmp_path / "cache").glob("assets-*-moe4/model")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:  # the HF checkpoint's own count
        hf_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    config = json.loads((model_dir / "config.json").read_text())
    padding = (padded_vocab_size(config["vocab_size"], 1) - config["vocab_size"]) * config["hidden_size"]
    assert result["results"]["grpo"]["num_parameters"] == hf_params + 2 * padding  # embedding + output layer
    assert_counts_every_token(result, "grpo", {"actor/log_prob", "ref/log_prob", "actor/update"})
