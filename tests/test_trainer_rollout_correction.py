"""Rollout correction in the trainer (CPU engine, fp32, DP 2 under torchrun) with a deliberately perturbed rollout
policy: the engine samples at temperature 0.2 while the actor's log-probs use 1.0, so the engine's policy is far
sharper than the one being trained.

Everything the update received is checked against an independent computation from the batch it was given (both
DP ranks' rows): the IS weights, the rejected tokens, the policy loss those imply, and the global batch
normalisation. The uncorrected perturbed run is the baseline the corrections must move away from.
"""
from __future__ import annotations

import json
import math

import pytest

from dist_util import REPO, run_torchrun
from e2e_assets import make_assets, tiny_overrides

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 11) / 10
'''
RC = "algorithm.rollout_correction"
ENGINE_TEMPERATURE = 0.2
TIS = [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0"]
REJECT = [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_2.0"]  # keep ratios in [0.5, 2]
CASES = {
    "matched": [TIS + REJECT, False],
    "perturbed_plain": [[], True],
    "perturbed_tis": [TIS, True],
    "perturbed_rs": [REJECT, True],
    "perturbed_seq_icepop_norm": [[f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=0.5_5.0",
                                   f"{RC}.rollout_is_batch_normalize=true"], True],
    "bypass_reinforce": [TIS + REJECT + [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce"], True],
}
# The same global batch at TP 2 x DP 1 (the engine seeds every sample by its global index: the same rollouts)
CASES["perturbed_seq_icepop_norm_tp2"] = [CASES["perturbed_seq_icepop_norm"][0] + [
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], True]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = make_assets(tmp_path_factory.mktemp("assets"))
    (root / "reward.py").write_text(REWARD)
    base = tiny_overrides(root, root / "run", world=2, steps=1, estimator="grpo", n=4) + [
        "critic.enable=false", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"reward.custom_fn.path={root}/reward.py", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1"]
    return run_torchrun(REPO / "tests" / "dist" / "trainer_rollout_correction.py", 2, root / "out",
                        ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--overrides", json.dumps(base),
                         "--cases", json.dumps(CASES), "--engine-temperature", str(ENGINE_TEMPERATURE)], timeout=600)


def rows(ranks: list[dict], case: str, key: str) -> list[list[float]]:
    """The global batch's rows of a captured tensor (DP rank order = rank order at TP 1)."""
    return [row for r in ranks for row in r[case]["captured"][key]]


def tokens(mask: list[list[float]]):
    return [(i, t) for i, row in enumerate(mask) for t, m in enumerate(row) if m]


def test_matched_engine_needs_no_correction(ranks):
    m = ranks[0]["matched"]["metrics"]
    assert m["training/rollout_probs_diff_max"] < 1e-3 and abs(m["rollout_corr/kl"]) < 1e-6
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_metrics_are_global_and_the_perturbation_shows(ranks):
    for case in CASES:
        values = [{k: v for k, v in r[case]["metrics"].items() if k.startswith(("rollout_corr/", "training/", "actor/"))}
                  for r in ranks]
        assert values[0] == values[1] and any(k.startswith("rollout_corr/") for k in values[0]), case
    plain = ranks[0]["perturbed_plain"]["metrics"]
    # KL(rollout || actor) > 0 and the probabilities disagree far more than fp32 noise
    assert plain["rollout_corr/kl"] > 0.02 and plain["rollout_corr/k3_kl"] > 0.01
    assert plain["training/rollout_probs_diff_max"] > 5e-3
    # without IS or rejection the update's forward supplies the old log-probs, and the metrics still come
    assert ranks[0]["perturbed_plain"]["reuse"] and not ranks[0]["perturbed_plain"]["pass"]
    assert "rollout_corr/chi2_token" in plain and "timing_s/old_log_prob" not in plain
    for case in ("perturbed_tis", "perturbed_rs", "perturbed_seq_icepop_norm"):  # they need them before the update
        assert ranks[0][case]["pass"] and "timing_s/old_log_prob" in ranks[0][case]["metrics"], case
        assert ranks[0][case]["metrics"]["rollout_corr/kl"] == pytest.approx(plain["rollout_corr/kl"], rel=1e-5)


def test_tis_weights_reach_the_policy_loss(ranks):
    """w = min(pi_actor / pi_engine, 2) per token: the sharper engine over-samples tokens the actor finds less
    likely, so many weights are < 1 (some > 1 are truncated); the loss is -sum(A w) / tokens (ratio 1)."""
    case, r0 = "perturbed_tis", ranks[0]["perturbed_tis"]
    old, roll = rows(ranks, case, "old_log_probs"), rows(ranks, case, "rollout_log_probs")
    mask, adv, w = rows(ranks, case, "response_mask"), rows(ranks, case, "advantages"), rows(ranks, case,
                                                                                          "rollout_is_weights")
    cells = tokens(mask)
    for i, t in cells:
        assert w[i][t] == pytest.approx(min(math.exp(old[i][t] - roll[i][t]), 2.0), rel=1e-5)
    assert all(w[i][t] == 0.0 for i, row in enumerate(mask) for t, m in enumerate(row) if not m)
    below = sum(w[i][t] < 0.99 for i, t in cells) / len(cells)
    truncated = sum(w[i][t] == 2.0 for i, t in cells) / len(cells)
    assert below > 0.3 and 0 < truncated == pytest.approx(r0["metrics"]["rollout_corr/rollout_is_ratio_fraction_high"],
                                                          abs=1e-6)
    assert sum(math.log(w[i][t]) for i, t in cells) < 0  # the weights' geometric mean is below 1
    expected = -sum(adv[i][t] * w[i][t] for i, t in cells) / len(cells)
    assert r0["metrics"]["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    plain = ranks[0]["perturbed_plain"]["metrics"]["actor/pg_loss"]
    assert abs(r0["metrics"]["actor/pg_loss"] - plain) > 1e-3  # the same rollouts, another update
    assert r0["weights_diff_to_plain"] > 1e-4


def test_rejection_masks_tokens_out_of_the_update(ranks):
    """token_k1 with ratio bounds [0.5, 2]: tokens whose actor/engine ratio leaves them get response_mask 0 and
    advantage 0; the loss is the mean over the kept tokens only."""
    case, r0 = "perturbed_rs", ranks[0]["perturbed_rs"]
    old, roll = rows(ranks, case, "old_log_probs"), rows(ranks, case, "rollout_log_probs")
    mask, adv = rows(ranks, case, "response_mask"), rows(ranks, case, "advantages")
    generated = rows(ranks, "perturbed_plain", "response_mask")
    assert "rollout_is_weights" not in r0["captured"]
    kept, rejected = 0, 0
    for i, t in tokens(generated):
        keep = math.log(0.5) <= -(old[i][t] - roll[i][t]) <= math.log(2.0)
        assert mask[i][t] == float(keep), (i, t)
        kept, rejected = kept + keep, rejected + (not keep)
        if not keep:
            assert adv[i][t] == 0.0
    assert rejected > 0 and kept > 0
    m = r0["metrics"]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / (kept + rejected), rel=1e-6)
    # response lengths are those generated; the update sees only the kept tokens
    assert m["response_length/mean"] == ranks[0]["perturbed_plain"]["metrics"]["response_length/mean"]
    expected = -sum(adv[i][t] for i, t in tokens(mask)) / kept
    assert m["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert r0["weights_diff_to_plain"] > 1e-4


def test_sequence_icepop_batch_normalised_over_the_global_batch(ranks):
    """One weight per response: exp(sum of its log-ratios), 0 outside [0.5, 5], divided by the mean weight of the
    rows over BOTH DP ranks (a per-rank mean would give each rank's rows mean 1 instead)."""
    case = "perturbed_seq_icepop_norm"
    old, roll = rows(ranks, case, "old_log_probs"), rows(ranks, case, "rollout_log_probs")
    mask, w = rows(ranks, case, "response_mask"), rows(ranks, case, "rollout_is_weights")
    raw = []
    for i, row in enumerate(mask):
        s = sum(old[i][t] - roll[i][t] for t, m in enumerate(row) if m)
        ratio = math.exp(max(-20.0, min(20.0, s)))
        raw.append(ratio if 0.5 <= ratio <= 5.0 else 0.0)
    with_tokens = [i for i, row in enumerate(mask) if any(row)]
    factor = sum(raw[i] for i in with_tokens) / len(with_tokens)
    assert 0 < sum(x == 0.0 for x in raw) < len(raw)  # IcePop zeroes some responses, not all
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            assert w[i][t] == pytest.approx(raw[i] / factor if m else 0.0, rel=1e-5, abs=1e-7)
    assert ranks[0][case]["metrics"]["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-5)
    per_rank = [sum(row[0] for row in r[case]["captured"]["rollout_is_weights"] if row[0]) for r in ranks]
    assert per_rank[0] != pytest.approx(per_rank[1], rel=1e-3)  # the ranks' shares differ: the mean is global


def test_bypass_mode_uses_the_engine_log_probs_and_reinforce_with_is_weights(ranks):
    """No old-log-prob pass: old_log_probs are the engine's. The REINFORCE loss weights -A log pi by
    min(pi / pi_engine, 2) over the tokens the k1 rejection keeps, divided by all generated tokens."""
    case, r0 = "bypass_reinforce", ranks[0]["bypass_reinforce"]
    m = r0["metrics"]
    assert not r0["pass"] and "timing_s/old_log_prob" not in m
    assert rows(ranks, case, "old_log_probs") == rows(ranks, case, "rollout_log_probs")
    actor, roll = rows(ranks, case, "actor_log_probs"), rows(ranks, case, "rollout_log_probs")
    mask, adv = rows(ranks, case, "response_mask"), rows(ranks, case, "advantages")
    total, kept, cells = 0.0, 0, tokens(mask)
    for i, t in cells:
        lr = actor[i][t] - roll[i][t]
        if math.log(0.5) <= -lr <= math.log(2.0):
            total += -adv[i][t] * actor[i][t] * min(math.exp(lr), 2.0)
            kept += 1
    assert 0 < kept < len(cells)
    assert m["actor/pg_loss"] == pytest.approx(total / len(cells), rel=1e-4, abs=1e-7)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 - kept / len(cells), rel=1e-5)
    # on-policy: the rollout-vs-actor metrics come from the update's forward, as in the uncorrected run
    plain = ranks[0]["perturbed_plain"]["metrics"]
    for key in ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "rollout_corr/kl"):
        assert m[key] == pytest.approx(plain[key], rel=1e-4), key


def test_weights_and_metrics_do_not_depend_on_the_dp_split(ranks):
    """DP 2 (each rank half of the rows) and TP 2 x DP 1 (every rank all rows): the same rollouts, the same
    globally normalised IS weights and the same rollout_corr/ and training/rollout_* metrics (fp32 TP noise)."""
    dp2, tp2 = "perturbed_seq_icepop_norm", "perturbed_seq_icepop_norm_tp2"
    assert rows(ranks, dp2, "rollout_log_probs") == ranks[0][tp2]["captured"]["rollout_log_probs"]
    assert rows(ranks, dp2, "response_mask") == ranks[0][tp2]["captured"]["response_mask"]
    for a, b in zip(rows(ranks, dp2, "rollout_is_weights"), ranks[0][tp2]["captured"]["rollout_is_weights"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    m_dp, m_tp = ranks[0][dp2]["metrics"], ranks[0][tp2]["metrics"]
    keys = [k for k in m_dp if k.startswith(("rollout_corr/", "training/rollout"))]
    assert sorted(keys) == sorted(k for k in m_tp if k.startswith(("rollout_corr/", "training/rollout")))
    assert "rollout_corr/rollout_is_batch_norm_factor" in keys and "training/rollout_probs_diff_max" in keys
    for key in keys:
        if math.isnan(m_dp[key]):
            assert math.isnan(m_tp[key]), key
        else:
            assert m_tp[key] == pytest.approx(m_dp[key], rel=1e-4, abs=1e-6), key
