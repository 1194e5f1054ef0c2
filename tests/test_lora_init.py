"""LoRA adapters' initialisation from the run seed (TP1 vs TP2) and their dropout, on 2 CPU ranks: one torchrun
launch (tests/dist/lora_init.py) runs every case."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_util import on_every_rank, run_cases

SCRIPT = Path(__file__).parent / "dist" / "lora_init.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_cases(SCRIPT, 2, tmp_path_factory.mktemp("lora_init"), timeout=600)


def test_initial_a_follows_the_actor_seed_and_is_the_same_at_tp1_and_tp2(ranks):
    """A is drawn from (the actor's megatron.seed = trainer.seed, the adapter's name) as full tensors: the same at
    TP1 and TP2 for one seed, different for another; B = 0 whatever the seed."""
    assert on_every_rank(ranks, "seed/a_keys") == [4 * 7] * 2  # 4 layers x 7 projections
    assert all(on_every_rank(ranks, "seed/same_keys"))
    for seed in (0, 5):
        assert all(on_every_rank(ranks, f"seed/{seed}/tp2_equals_tp1")), seed
    assert all(on_every_rank(ranks, "seed/other_seed_differs"))
    assert all(on_every_rank(ranks, "seed/b_zero"))


def test_dropout_is_off_in_log_prob_passes_and_matches_peft_in_training(ranks):
    """lora.dropout = 0.3: the log-prob pass (eval mode, even after a training-mode call) is bitwise dropout 0; in
    training mode, from the same generator state, the logits equal HF + PEFT's with lora_dropout 0.3 (the same
    masks: one per adapter, drawn in PEFT's order), and differ from eval's by far more."""
    assert all(on_every_rank(ranks, "dropout/eval_bitwise_dropout0"))
    # fp32 logits, |diff| 7.5e-6 measured; one mask shared by q/k/v (and gate/up), as before, gives ~4.6
    assert max(on_every_rank(ranks, "dropout/train_vs_peft_same_masks")) <= 5e-5
    assert min(on_every_rank(ranks, "dropout/train_vs_eval")) > 1e-2


def test_dropout_masks_follow_the_tp_split_of_the_input(ranks):
    """At TP2: a replicated input (linear_qkv, no sequence parallelism) gets the same masks on both TP ranks (so the
    replicated A x agrees), a TP-split one (linear_proj's) different ones, as slices of one full-input mask; q, k
    and v each get a mask of their own; about 70% of the inputs are kept."""
    assert on_every_rank(ranks, "dropout/tp2/linear_qkv/same_on_tp_ranks") == [True, True]
    assert on_every_rank(ranks, "dropout/tp2/linear_proj/same_on_tp_ranks") == [False, False]
    assert all(on_every_rank(ranks, "dropout/tp2/qkv_masks_per_projection_differ"))
    for name in ("linear_qkv", "linear_proj"):
        assert all(abs(f - 0.7) < 0.1 for f in on_every_rank(ranks, f"dropout/tp2/{name}/keep_fraction")), name
