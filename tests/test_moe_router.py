"""MoE router losses (`megatron.override_transformer_config.moe_aux_loss_coeff` / `moe_z_loss_coeff`) and routing
replay's mechanism (`actor.router_replay.mode=R3`) on a tiny Qwen3-MoE (2 CPU ranks; DP2, EP2, PP2 and TP2 with
sequence parallelism, as megatron-core trains MoE layers under TP only with it):
- the reported `actor/moe_aux_loss` and `actor/moe_z_loss` equal the Switch load-balancing loss and the z-loss
  computed from HF's router logits by naive formulas, the coefficients put exactly coeff x their gradient on the
  router weights, and coefficients 0 mean no metric and no gradient;
- with routes replayed, the actor's log-probs equal HF's with its routers forced to those experts.
One torchrun launch (tests/dist/moe_router.py) runs every case.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_util import run_cases

SCRIPT = Path(__file__).parent / "dist" / "moe_router.py"
LAYOUTS = ("dp2", "ep2", "pp2", "tp2sp")
LOSS_LAYOUTS = ("dp2", "ep2", "pp2", "tp2sp")  # megatron-core trains MoE under TP only with sequence parallelism


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_cases(SCRIPT, 2, tmp_path_factory.mktemp("moe_router"), timeout=600)


@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
def test_metrics_equal_the_naive_switch_and_z_losses(ranks, layout):
    for r in ranks:
        got, ref = r[f"{layout}/aux_and_z/metrics"], r[f"{layout}/aux_and_z/ref"]
        assert sorted(got) == ["actor/moe_aux_loss", "actor/moe_z_loss"]
        assert got["actor/moe_aux_loss"] > 1.0  # 1 = perfectly balanced; a random router is not
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key
    assert ranks[0][f"{layout}/aux_and_z/metrics"] == ranks[1][f"{layout}/aux_and_z/metrics"]


def test_aux_only_reports_no_z_loss(ranks):
    for r in ranks:
        got = r["dp2/aux_only/metrics"]
        assert sorted(got) == ["actor/moe_aux_loss"]
        assert got["actor/moe_aux_loss"] == pytest.approx(r["dp2/aux_only/ref"]["actor/moe_aux_loss"], rel=1e-5)


@pytest.mark.parametrize("layout, coeffs", [(layout, "aux_and_z") for layout in LOSS_LAYOUTS] + [("dp2", "aux_only")])
def test_router_gradient_is_coeff_times_the_losses_gradient(ranks, layout, coeffs):
    for r in ranks:
        ref_max = r[f"{layout}/{coeffs}/router_grad_ref_max"]
        assert ref_max > 1e-4
        assert r[f"{layout}/{coeffs}/router_grad_diff"] <= 1e-5 * max(1.0, ref_max), layout


@pytest.mark.parametrize("layout", LOSS_LAYOUTS)
def test_zero_coefficients_mean_no_metric_and_no_gradient(ranks, layout):
    for r in ranks:
        assert r[f"{layout}/off/metrics"] == {}
        assert r[f"{layout}/off/router_grad_got_max"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replayed_routes_give_hfs_log_probs_with_those_experts_forced(ranks, layout):
    for r in ranks:
        assert r[f"{layout}/replay/replayed_vs_forced_hf"] <= 1e-4
        assert r[f"{layout}/replay/hf_free_vs_forced_hf"] > 0.1  # the random routes differ from the model's own
        assert r[f"{layout}/replay/no_routes_error"].startswith(
            "actor_rollout_ref.actor.router_replay.mode=R3 but this batch has no routed_experts")
