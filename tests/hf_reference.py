"""HF transformers as the independent reference for rollout engines: log-probs of given tokens, and Qwen3-MoE's
router top-k on the same tokens (the routes an engine must report for routing replay)."""
from __future__ import annotations

import torch


def hf_token_log_probs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(token_i | prompt, tokens[:i]) of an HF causal LM, fp32, temperature-scaled."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def hf_router_top_k(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts HF's Qwen3-MoE routers choose for every token but the last of prompt + tokens: sorted ids
    [P + T - 1, MoE layers, k], and the gap between the k-th and the (k+1)-th router probability per row (a tie
    when ~0: an engine may then pick either)."""
    ids = torch.tensor([prompt + tokens])
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits  # one [P + T, E] per MoE layer
    probs = torch.stack([torch.softmax(r.float(), -1) for r in router_logits], dim=1)[:-1]  # [P + T - 1, L, E]
    top = probs.topk(k + 1 if k < probs.shape[-1] else k, dim=-1)
    gap = (top.values[..., k - 1] - top.values[..., k]) if k < probs.shape[-1] else torch.ones(probs.shape[:2])
    return top.indices[..., :k].sort(-1).values.to(torch.int32), gap


def route_disagreements(engine_routes: torch.Tensor, hf_ids: torch.Tensor, gap: torch.Tensor,
                        tie: float = 1e-5) -> dict:
    """Compare an engine's routes with HF's (as sets of k experts): rows that differ, and those of them that are
    not ties."""
    if tuple(engine_routes.shape) != tuple(hf_ids.shape):
        return {"rows": 0, "different": -1, "different_not_tie": -1, "shape_equal": False,
                "shapes": [list(engine_routes.shape), list(hf_ids.shape)]}
    same = (engine_routes.sort(-1).values == hf_ids).all(-1)  # [rows, layers]
    return {"rows": int(same.numel()), "different": int((~same).sum()),
            "different_not_tie": int((~same & (gap > tie)).sum()),
            "shape_equal": tuple(engine_routes.shape) == tuple(hf_ids.shape)}
