"""Turn prompts and sampled responses into the padded tensor batch every worker consumes (veRL's layout).

Row r of the batch is sample `r % n` of prompt `r // n` (prompt-major, as engines return them):

    input_ids      [B·n, P+T]  left-padded prompt ++ right-padded response
    attention_mask [B·n, P+T]  1 on real tokens
    position_ids   [B·n, P+T]  0 at each prompt's first token, counting through the response
    prompt_mask    [B·n, P]
    responses      [B·n, T]    T = max_response_length (fixed, so every rank and micro-batch agrees on shapes)
    response_mask  [B·n, T]    1 on tokens in the loss: generated ones (0 on a multi-turn response's tool turns)
    rollout_log_probs [B·n, T] the engine's log-probs (diagnostics: rollout vs actor mismatch)
    routed_experts [B·n, P+T, MoE layers, top_k] int32, when the engine recorded them (routing replay R3): the
                   experts each MoE layer chose for each token, by input_ids column; columns the engine did not run
                   (padding, the last response token) hold experts 0..k-1
    num_tool_calls [B·n]       multi-turn responses only (mppo.rollout.agent_loop): tool calls per response
    policy_version [B·n]       the version (trainer steps done) of the weights that generated each response (the
                               oldest of its tokens' under partial rollouts)
    rollout_token_versions [B·n, T]  partial rollouts only: the version that generated each token, -1 on padding
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mppo.data.loader import PromptBatch
from mppo.parallel import collective_device
from mppo.rollout.base import RolloutResponse


def build_rollout_batch(prompts: PromptBatch, responses: Sequence[RolloutResponse], *, n: int,
                        max_response_length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    if len(responses) != len(prompts) * n:
        raise ValueError(f"expected {len(prompts)} prompts × n={n} responses, got {len(responses)}")
    rows = len(responses)
    responses_t = torch.full((rows, max_response_length), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros((rows, max_response_length), dtype=torch.float32)
    # attended response tokens; differs from response_mask where a multi-turn response has tool turns (loss_mask 0)
    valid = torch.zeros((rows, max_response_length), dtype=torch.int64)
    rollout_log_probs = torch.zeros((rows, max_response_length), dtype=torch.float32)
    for r, resp in enumerate(responses):
        length = len(resp.token_ids)
        if length > max_response_length:
            raise ValueError(f"engine returned {length} tokens for prompt {resp.prompt_index}, more than "
                             f"max_response_length={max_response_length}")
        responses_t[r, :length] = torch.tensor(resp.token_ids, dtype=torch.int64)
        valid[r, :length] = 1
        response_mask[r, :length] = (1.0 if resp.loss_mask is None  # multi-turn: 0 on the tool turns
                                     else torch.tensor(resp.loss_mask, dtype=torch.float32))
        rollout_log_probs[r, :length] = torch.tensor(resp.log_probs, dtype=torch.float32)
    extra = {}
    if responses and responses[0].policy_version is not None:  # the weights' version that generated each sample
        extra["policy_version"] = torch.tensor([r.policy_version for r in responses], dtype=torch.int64)
    if responses and responses[0].token_versions is not None:  # partial rollouts
        versions = torch.full((rows, max_response_length), -1, dtype=torch.int64)
        for r, resp in enumerate(responses):
            versions[r, :len(resp.token_versions)] = torch.tensor(resp.token_versions, dtype=torch.int64)
        extra["rollout_token_versions"] = versions
    if responses and responses[0].num_tool_calls is not None:  # agent loop responses
        extra["num_tool_calls"] = torch.tensor([r.num_tool_calls for r in responses], dtype=torch.int64)
    rows_prompts = prompts.repeat(n)  # row r's prompt
    prompt_ids, prompt_mask = rows_prompts.input_ids, rows_prompts.attention_mask
    attention_mask = torch.cat([prompt_mask, valid], dim=1)
    batch = {
        "input_ids": torch.cat([prompt_ids, responses_t], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "prompt_mask": prompt_mask,
        "responses": responses_t,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        # Group id of each row: the prompt's GLOBAL dataset index (GRPO-style estimators group by it).
        "uid": rows_prompts.indices,
        **extra,  # policy_version, rollout_token_versions, num_tool_calls (multi-turn): see the module docstring
    }
    if responses and responses[0].routed_experts is not None:
        batch["routed_experts"] = _routes_by_column(responses, prompt_mask, max_response_length)
    return batch


def _routes_by_column(responses: Sequence[RolloutResponse], prompt_mask: torch.Tensor,
                      max_response_length: int) -> torch.Tensor:
    """Each response's routes (its prompt's tokens, then its fed response tokens) at their input_ids columns:
    the prompt is left-padded to P columns, the response starts at column P."""
    rows, width = prompt_mask.shape
    layers, k = responses[0].routed_experts.shape[1:]
    out = torch.arange(k, dtype=torch.int32).expand(rows, width + max_response_length, layers, k).clone()
    for r, resp in enumerate(responses):
        prompt_len = int(prompt_mask[r].sum())
        routes = resp.routed_experts
        if routes.shape[0] != prompt_len + len(resp.token_ids) - 1:
            raise ValueError(f"engine returned routes for {routes.shape[0]} tokens of prompt {resp.prompt_index}, "
                             f"expected prompt {prompt_len} + response {len(resp.token_ids)} - 1")
        out[r, width - prompt_len:width - prompt_len + routes.shape[0]] = routes
    return out


def all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate equal-shaped per-rank row blocks along dim 0, in rank order (identity without a group)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    device = collective_device(group)
    parts = [torch.empty_like(tensor, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.to(device).contiguous(), group=group)
    return torch.cat(parts, dim=0).to(tensor.device)


def local_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's block of a gathered tensor (the inverse of all_gather_rows)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return tensor.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)]
