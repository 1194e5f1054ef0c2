"""Model FLOPs of a PPO step, for MFU: the matmuls each pass really runs, counted from the architecture.

Per token, one forward through the transformer body is 2 FLOPs per weight of its linear layers (QKV, attention
output, SwiGLU's gate/up/down); a forward + backward is 3 times that. The output layer (vocab x hidden) runs only
where logits are needed: on the response tokens (generation samples them; the log-prob passes and the actor
update score them with the fused kernel, which never computes prompt logits), so it is counted there only. The
input embedding is a lookup and costs nothing. The critic's value head (hidden -> 1) is negligible.

Counting `6 x parameters x all tokens` instead over-counts small models with big vocabularies: SmolLM2-135M's
vocab x hidden output layer is 21% of its parameters, and ~60% of a demo step's tokens are prompt tokens, which
is how `perf/mfu` exceeded 1 (issue 14, together with a single, noisy peak measurement).

A MoE layer runs, per token, its router (hidden -> experts) and the top-k experts it picked: the active
parameters, not all experts (a Qwen3-30B-A3B token uses ~3B of the 30B; counting all would put MFU 10x too high).

Attention's score and value matmuls (quadratic in the sequence length) are left out: at RL sequence lengths they
are a few percent, and leaving them out keeps the MFU figure conservative. Re-computation is not counted either.
"""
from __future__ import annotations

from mppo.models.hf_config import HFModelArgs


def body_flops_per_token(args: HFModelArgs) -> float:
    """Forward FLOPs per token of the transformer layers' linear layers (no embedding, no output layer)."""
    h, d = args.hidden_size, args.head_dim
    attention = h * d * (args.num_attention_heads + 2 * args.num_query_groups) + args.num_attention_heads * d * h
    dense_mlp = 3 * h * args.ffn_hidden_size  # gate, up (h -> F each) and down (F -> h)
    moe_mlp = (h * args.num_experts + args.moe_topk * 3 * h * args.moe_ffn_hidden_size) if args.is_moe else 0
    moe_layers = len(args.moe_layers)
    return 2.0 * (args.num_layers * attention + (args.num_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp)


def output_layer_flops_per_token(args: HFModelArgs) -> float:
    """Forward FLOPs per token of the output layer (hidden -> vocab logits)."""
    return 2.0 * args.vocab_size * args.hidden_size


def ppo_step_flops(args: HFModelArgs, *, prompt_tokens: int, response_tokens: int, use_critic: bool, use_ref: bool,
                   old_log_prob_pass: bool = True) -> float:
    """Generation (1 forward), old log-probs (1, unless the update's forward supplies them: on-policy reuse),
    ref (1), values (1, body only), actor and critic updates (3 each; the critic's without the output layer)."""
    tokens = prompt_tokens + response_tokens
    body, head = body_flops_per_token(args), output_layer_flops_per_token(args)
    policy_passes = 1 + (1 if old_log_prob_pass else 0) + (1 if use_ref else 0) + 3  # gen, old, ref, update
    critic_passes = (1 + 3) if use_critic else 0  # values, update
    return body * tokens * (policy_passes + critic_passes) + head * response_tokens * policy_passes
