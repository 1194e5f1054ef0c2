"""Model FLOPs of a PPO step, for MFU: the usual 2·params per token forward, 6·params per token forward+backward."""
from __future__ import annotations


def ppo_step_flops(num_parameters: int, num_tokens: int, *, use_critic: bool, use_ref: bool,
                   old_log_prob_pass: bool = True) -> float:
    """Generation (1 forward), old log-probs (1, unless the update's forward supplies them: on-policy reuse),
    ref (1), values (1), actor and critic updates (3 each).

    Attention's quadratic term is left out: at RL sequence lengths (≤ a few thousand) it is a few percent, and
    leaving it out makes the MFU figure conservative. Re-computation is not counted as useful work either.
    """
    forwards = 1 + (1 if old_log_prob_pass else 0) + (1 if use_ref else 0) + (1 if use_critic else 0)
    updates = 1 + (1 if use_critic else 0)
    return 2.0 * num_parameters * num_tokens * (forwards + 3 * updates)
