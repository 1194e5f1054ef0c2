"""LoRA adapters' initialisation from the run seed (TP1 vs TP2), on 2 CPU ranks: one torchrun launch
(tests/dist/lora_init.py) runs every case."""
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

