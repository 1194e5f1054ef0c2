"""The trainer's sampling parameters come from the rollout config key for key (train and validation)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mppo.config import load_config
from mppo.trainer.components import train_sampling, val_sampling


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_rollout_keys_reach_the_sampling_params(ignore_eos):
    cfg = load_config(None, [f"actor_rollout_ref.rollout.ignore_eos={str(ignore_eos).lower()}",
                             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=0.7",
                             "actor_rollout_ref.rollout.top_k=5", "data.max_response_length=33", "trainer.seed=9"])
    tokenizer = SimpleNamespace(eos_token_id=7)
    train = train_sampling(cfg, tokenizer)
    assert (train.n, train.temperature, train.top_k, train.max_new_tokens, train.seed) == (4, 0.7, 5, 33, 9)
    assert train.stop_token_ids == (7,) and train.do_sample
    # veRL sets ignore_eos on the engine, so it holds for validation requests as well
    assert train.ignore_eos is ignore_eos and val_sampling(cfg, tokenizer).ignore_eos is ignore_eos
