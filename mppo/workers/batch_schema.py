"""The step's batch, declared once: every key a PPO step's batch (a dict of tensors per DP rank) may hold, its shape
and dtype, who writes it, who reads it and when it exists.

The trainer and the workers take their key lists from here (`read_by`): what the advantages and the step metrics
gather over DP, what a generation dump writes, what an update carries into its micro-batches.
tests/test_batch_schema.py fails when code in the trainer or the workers reads a key declared nowhere here, and
checks a real step's batch against the shapes and dtypes below.

Shapes: B rows (prompt-major: row r is sample r % n of prompt r // n), P prompt columns (left-padded), T response
columns (right-padded, T = data.max_response_length), L MoE layers, k experts per token. Pure: no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchKey:
    shape: str
    dtype: str
    writer: str
    readers: tuple[str, ...]  # tags: who reads it (see READERS)
    when: str = "always"
    doc: str = ""


# Reader tags: the lists of keys the code takes from here.
READERS = {
    "workers": "every worker pass (log-probs, values, updates): the data contract of mppo.workers.batching",
    "update": "an actor or critic update, carried into its micro-batches when present",
    "kl_penalty": "the KL penalty in the reward, gathered over DP (the whole global batch)",
    "advantages": "advantage estimation (with rollout correction and overlong filtering), gathered over DP",
    "metrics": "the step's data metrics, gathered over DP",
    "dump": "the generations written to trainer.rollout_data_dir",
    "trainer": "the fit loop and its helpers (rewards, rollout correction, dynamic sampling, off-policy metrics)",
}

UNREJECTED_MASK = "response_mask_before_rejection"
FILTER_METRIC = "filter_metric"
ROUTES_KEY = "routed_experts"

BATCH: dict[str, BatchKey] = {
    # --------------------------------------------------------------- the rollout (mppo.trainer.rollout_batch)
    "input_ids": BatchKey("[B, P+T]", "int64", "rollout", ("workers", "dump"),
                          doc="left-padded prompt ++ right-padded response"),
    "attention_mask": BatchKey("[B, P+T]", "int64", "rollout", ("workers", "dump"), doc="1 on real tokens"),
    "position_ids": BatchKey("[B, P+T]", "int64", "rollout", ("workers",),
                             doc="cumsum(attention_mask) - 1: 0 at each prompt's first token"),
    "responses": BatchKey("[B, T]", "int64", "rollout", ("workers", "advantages", "trainer", "dump"),
                          doc="input_ids[:, P:]"),
    "response_mask": BatchKey("[B, T]", "float32", "rollout; masked by rollout correction's rejection and "
                              "algorithm.mask_truncated_responses",
                              ("workers", "kl_penalty", "advantages", "metrics", "trainer"),
                              doc="1 on tokens in the loss (0 on padding and on a multi-turn response's tool turns)"),
    "prompt_mask": BatchKey("[B, P]", "int64", "rollout", ("metrics", "trainer", "dump")),
    "rollout_log_probs": BatchKey("[B, T]", "float32", "rollout", ("advantages", "trainer"),
                                  doc="the engine's log-probs of the sampled tokens"),
    "uid": BatchKey("[B]", "int64", "rollout", ("advantages", "trainer", "dump"),
                    doc="the prompt's global dataset index: the group id of GRPO-style estimators"),
    "policy_version": BatchKey("[B]", "int64", "rollout", ("trainer",),
                               doc="trainer steps done by the weights that generated the sample (the oldest of "
                                   "its tokens' under partial rollouts)"),
    "rollout_token_versions": BatchKey("[B, T]", "int64", "rollout", ("trainer",),
                                       when="async_training.partial_rollout",
                                       doc="the weights' version of each token, -1 on padding"),
    "num_tool_calls": BatchKey("[B]", "int64", "rollout", ("metrics", "dump"),
                               when="actor_rollout_ref.rollout.multi_turn.enable"),
    ROUTES_KEY: BatchKey("[B, P+T, L, k]", "int32", "rollout", ("workers",),
                         when="actor.router_replay.mode=R3",
                         doc="the experts the engine chose per token and MoE layer, by input_ids column"),
    # ---------------------------------------------------------------------------- the reward (the fit loop)
    "token_level_scores": BatchKey("[B, T]", "float32", "reward (on the response's last token); DAPO's overlong "
                                   "penalty", ("kl_penalty", "metrics", "trainer", "dump")),
    "reward_errors": BatchKey("[1]", "float32", "reward", ("trainer",),
                              doc="responses the reward function failed on (scored 0)"),
    FILTER_METRIC: BatchKey("[B]", "float32", "reward", ("trainer",), when="algorithm.filter_groups.enable",
                            doc="the reward extra info that dynamic sampling filters groups on"),
    "reward_baselines": BatchKey("[B]", "float32", "reward (ReMax's greedy rollout)", ("advantages",),
                                 when="the estimator needs reward_baselines (remax)"),
    # --------------------------------------------------------------------- the passes before the update
    "old_log_probs": BatchKey("[B, T]", "float32", "the old-log-prob source (mppo.config.decisions): the actor's "
                              "log-prob pass, or the engine's log-probs in bypass mode",
                              ("update", "kl_penalty", "advantages", "trainer"),
                              when="unless the actor update's own forward supplies them (on-policy reuse)"),
    "sum_pi_squared": BatchKey("[B, T]", "float32", "the actor's log-prob pass", ("advantages",),
                               when="actor.calculate_sum_pi_squared (the estimator needs it)"),
    "ref_log_prob": BatchKey("[B, T]", "float32", "the reference", ("update", "kl_penalty"),
                             when="a KL term: algorithm.use_kl_in_reward or actor.use_kl_loss"),
    "values": BatchKey("[B, T]", "float32", "the critic", ("update", "advantages", "metrics"),
                       when="a critic (critic.enable)"),
    # ------------------------------------------------------------------------- KL penalty and advantages
    "token_level_rewards": BatchKey("[B, T]", "float32", "the KL penalty (the scores without use_kl_in_reward)",
                                    ("advantages", "metrics")),
    "rollout_is_weights": BatchKey("[B, T]", "float32", "rollout correction", ("update",),
                                   when="algorithm.rollout_correction.rollout_is"),
    UNREJECTED_MASK: BatchKey("[B, T]", "float32", "rollout correction's rejection, overlong filtering",
                              ("metrics",), when="a response_mask was masked further",
                              doc="response_mask as generated, for the response-length metrics"),
    "advantages": BatchKey("[B, T]", "float32", "the advantage estimator", ("update", "metrics")),
    "returns": BatchKey("[B, T]", "float32", "the advantage estimator", ("update", "metrics")),
    # ------------------------------------------------------------------------------------- after the update
    "forward_log_probs": BatchKey("[B, T]", "float32", "the actor update (its first forward of each row)",
                                  ("trainer",), when="on-policy reuse or bypass mode, for the mismatch metrics"),
}

# Keys of a worker's micro-batches only (mppo.workers.pipeline writes them from the batch's masks).
MICRO_BATCH: dict[str, BatchKey] = {
    "response_index": BatchKey("[b, T]", "int64", "workers.pipeline", ("workers",),
                               doc="the compacted column whose output predicts each response token"),
    "response_valid": BatchKey("[b, T]", "bool", "workers.pipeline", ("workers",),
                               doc="response tokens the model attends (response_mask may drop tool turns)"),
}


def read_by(reader: str) -> tuple[str, ...]:
    """The keys `reader` (a READERS tag) reads, in declaration order."""
    if reader not in READERS:
        raise KeyError(f"unknown reader {reader!r}; one of {sorted(READERS)}")
    return tuple(name for name, key in BATCH.items() if reader in key.readers)
