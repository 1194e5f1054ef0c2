"""Which path the actor's loss takes, and the fused one's adapter from a micro-batch to the kernel.

- fused: `mppo.kernels.fused_linear_ppo_loss` goes from the final hidden states to the loss and computes the
  gradients w.r.t. the hidden states and the LM head during its forward (6·N·V·H FLOPs instead of 8). It covers a
  loss whose token gradients are known from each token alone: veRL's vanilla PPO clip (dual clip, clip-higher),
  every loss_agg_mode (linear in the token losses, weights from the mask and GlobalBatchInfo), rollout IS weights
  (a per-token factor), the entropy bonus, and every KL-loss estimator (per-token functions of the log-prob).
- reference: log-probs from `actor.logprob_impl` (the fused log-prob op recomputes its logits in the backward;
  naive materialises them), then the loss from `core_algos` — every other loss mode (gspo, geo_mean, clip_cov, ...
  couple the tokens of a sequence or a batch; the others are not implemented in the kernel).
`core_algos` is the reference the kernel is tested against. The no-grad passes (old and reference log-probs)
always use the log-prob op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mppo.config.schema import ActorConfig
from mppo.core_algos import GlobalBatchInfo, PolicyLossParams, agg_token_weights
from mppo.parallel.context_parallel import cp_world_size, sum_over_cp
from mppo.workers.base import output_weight, response_rows, share_of
from mppo.workers.batching import Batch

# Policy losses the fused kernel implements (their per-token closed forms: mppo/kernels/ppo_token_loss.py).
FUSED_POLICY_LOSSES = ("vanilla",)


@dataclass(frozen=True)
class LossPath:
    fused: bool
    reason: str

    def describe(self) -> str:
        return f"{'fused gradient-in-forward kernel' if self.fused else 'reference path'} ({self.reason})"


def select_loss_path(cfg: ActorConfig, *, rollout_correction_bypass: bool = False) -> LossPath:
    """The actor update's loss path for a config, and why."""
    if rollout_correction_bypass:
        return LossPath(False, "algorithm.rollout_correction.bypass_mode: the loss is rollout correction's bypass "
                               "loss (core_algos)")
    if cfg.logprob_impl != "fused":
        return LossPath(False, f"actor.logprob_impl={cfg.logprob_impl}: log-probs from full logits, loss from "
                               "core_algos")
    mode = cfg.policy_loss.loss_mode
    if mode not in FUSED_POLICY_LOSSES:
        return LossPath(False, f"policy_loss.loss_mode={mode} is not in the fused kernel ({', '.join(FUSED_POLICY_LOSSES)}"
                               "): fused log-probs recomputed in the backward, loss from core_algos")
    terms = [f"loss_mode={mode}", f"loss_agg_mode={cfg.loss_agg_mode}"]
    if cfg.entropy_coeff != 0:
        terms.append(f"entropy_coeff={cfg.entropy_coeff}")
    if cfg.use_kl_loss:
        terms.append(f"kl_loss_type={cfg.kl_loss_type}")
    return LossPath(True, f"{', '.join(terms)}; kernel_backend={cfg.kernel_backend}")


def fused_actor_loss(model: nn.Module, hidden: torch.Tensor, data: Batch, cfg: ActorConfig, info: GlobalBatchInfo,
                     *, params: PolicyLossParams, temperature: float, vocab_size: int
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, metric contributions, detached log-probs [b, T]) of one micro-batch from the last stage's hidden
    states [s, b, h], as ActorWorker's reference loss function computes them: the loss is this micro-batch's
    share of the global mini-batch loss × dp, each metric contribution is its share of the global value
    (StepMetrics; float64 device scalars, no host sync), and the log-probs are 0 where the response mask is.
    Under context parallelism (`data` the CP-local view) the kernel runs on this CP rank's tokens: the loss is their
    part of the micro-batch's (the token weights come from the whole mask), and the metric contributions and
    log-probs are summed over CP, so every CP rank holds the micro-batch's."""
    from megatron.core import parallel_state as ps

    from mppo.kernels import PPOTokenLoss, fused_linear_ppo_loss

    valid, mask = data["response_valid"], data["response_mask"]
    weights = agg_token_weights(mask, cfg.loss_agg_mode, **info.as_kwargs())

    def tokens(key: str) -> torch.Tensor | None:
        return data[key][valid] if key in data else None

    spec = PPOTokenLoss(
        advantages=data["advantages"][valid], weights=weights[valid], mask=mask[valid],
        old_log_prob=tokens("old_log_probs"),  # absent on-policy: this forward is the old policy
        rollout_is_weights=tokens("rollout_is_weights"),
        ref_log_prob=tokens("ref_log_prob") if cfg.use_kl_loss else None,
        clip_ratio_low=params.low, clip_ratio_high=params.high, clip_ratio_c=params.clip_ratio_c,
        entropy_coeff=cfg.entropy_coeff, kl_loss_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0,
        kl_loss_type=cfg.kl_loss_type)
    out = fused_linear_ppo_loss(response_rows(hidden, data, valid_only=True), output_weight(model),
                                data["responses"][valid], spec, temperature=temperature,
                                tp_group=ps.get_tensor_model_parallel_group(), valid_vocab_size=vocab_size,
                                backend=cfg.kernel_backend)
    # every number stays on the device (StepMetrics reads them once per optimizer step); fp32 stats -> float64
    # exactly as the host's float() does
    stats = out.stats.detach().double()
    pg_loss, entropy_loss, kl_loss, clipfrac, ppo_kl, clipfrac_lower = (stats[i] for i in range(6))
    dp = info.dp_size
    # the kernel's masked means are over its tokens: those of `valid` (under CP this rank's; else mask <= valid)
    token_share = share_of(mask[valid].sum().to(out.stats), info.batch_num_tokens)
    contributions = {"actor/pg_loss": share_of(pg_loss, dp), "actor/entropy": share_of(entropy_loss, dp),
                     "actor/pg_clipfrac": clipfrac * token_share, "actor/ppo_kl": ppo_kl * token_share,
                     "actor/pg_clipfrac_lower": clipfrac_lower * token_share}
    if cfg.use_kl_loss:
        contributions["actor/kl_loss"] = share_of(kl_loss, dp)
    if cp_world_size() > 1:  # one all-reduce of the few scalars: every CP rank then holds the micro-batch's values
        keys = list(contributions)
        summed = sum_over_cp(torch.stack([contributions[k] for k in keys]))
        contributions = {k: summed[i] for i, k in enumerate(keys)}
    log_probs = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    log_probs[valid] = out.log_probs.detach().float()
    return out.loss, contributions, sum_over_cp(log_probs)
