"""Batches in the workers' data contract and plain-torch references (HF transformers + core_algos + torch AdamW)
for the worker tests. Nothing here uses mppo.workers: the references are independent of the code under test."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

B, P, T = 8, 6, 7  # rows, prompt columns, response columns
TEMPERATURE = 0.7
PROMPT_LENGTHS = [6, 3, 5, 1, 4, 6, 2, 5]
RESPONSE_LENGTHS = [7, 2, 5, 0, 7, 3, 1, 6]  # row 3: empty response (excluded from seq-mean denominators)


def make_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts ++ right-padded responses (pad id 0), veRL's position_ids, and update inputs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, P + T), generator=g)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for i, (p, t) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        mask[i, P - p:P + t] = 1
    ids[mask == 0] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    # veRL: response positions continue after the last prompt position, also over padding
    positions[:, P:] = positions[:, P - 1:P] + torch.arange(1, T + 1)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, P:].clone(),
             "response_mask": mask[:, P:].float()}
    batch["advantages"] = torch.randn(B, T, generator=g)
    batch["values"] = 0.5 * torch.randn(B, T, generator=g)
    batch["returns"] = torch.randn(B, T, generator=g)
    return batch


def dp_shard(batch: dict, dp: int, dp_rank: int) -> dict:
    """Rows dp_rank::dp: with mini-batches cut per rank, global mini-batch k is then rows [k*m, (k+1)*m) for
    every dp, so layouts with different DP see the same global mini-batches."""
    return {k: v[dp_rank::dp].clone() for k, v in batch.items()}


def hf_response_logprobs(hf, batch: dict, temperature: float = TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T) gathered at the response tokens, and the entropy, [B, T] (differentiable)."""
    out = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
             position_ids=batch["position_ids"])
    logits = out.logits.float()[:, P - 1:-1] / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    valid = batch["attention_mask"][:, P:].bool()
    return lp * valid, ent * valid


def hf_values(hf, head: torch.nn.Linear, batch: dict) -> torch.Tensor:
    """Critic values [B, T] read at the position before each response token (veRL's [:, -T-1:-1])."""
    hidden = hf.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"]).last_hidden_state
    return head(hidden).squeeze(-1)[:, P - 1:-1]


def add_value_head(src: Path, dst: Path, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF critic checkpoint: the model's tensors plus a random `score` head (AutoModelForTokenClassification
    naming). Returns (weight [1, h], bias [1])."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    g = torch.Generator().manual_seed(seed)
    tensors["score.weight"] = 0.3 * torch.randn(1, hidden, generator=g)
    tensors["score.bias"] = 0.1 * torch.randn(1, generator=g)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return tensors["score.weight"], tensors["score.bias"]


def reference_actor_updates(hf, batch: dict, *, mini_batch_size: int, lr: float, eps: float, clip_grad: float,
                            loss_agg_mode: str, clip_low: float, clip_high: float, entropy_coeff: float,
                            kl_coef: float, kl_type: str,
                            loss_mode: str = "vanilla") -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """One PPO update in plain torch: per global mini-batch, HF log-probs -> core_algos losses -> backward ->
    clip -> AdamW. Returns the updated HF state dict and each optimizer step's metrics."""
    from mppo.core_algos import agg_loss, compute_policy_loss, kl_penalty

    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0)
    steps = []
    for start in range(0, B, mini_batch_size):
        mb = {k: v[start:start + mini_batch_size] for k, v in batch.items()}
        lp, ent = hf_response_logprobs(hf, mb)
        mask = mb["response_mask"]
        pg_loss, pg_metrics = compute_policy_loss(mb["old_log_probs"], lp, mb["advantages"], mask, loss_agg_mode,
                                                  loss_mode=loss_mode, clip_ratio_low=clip_low,
                                                  clip_ratio_high=clip_high)
        entropy = agg_loss(ent, mask, loss_agg_mode)
        kl = agg_loss(kl_penalty(lp, mb["ref_log_prob"], kl_type), mask, loss_agg_mode)
        loss = pg_loss - entropy_coeff * entropy + kl_coef * kl
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad)
        opt.step()
        steps.append({"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy.item(), "actor/kl_loss": kl.item(),
                      "actor/grad_norm": norm.item(), **pg_metrics})
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}, steps


def reference_critic_updates(hf, head: torch.nn.Linear, batch: dict, *, mini_batch_size: int, lr: float,
                             eps: float, clip_grad: float, loss_agg_mode: str, cliprange_value: float,
                             epochs: int = 1) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """One critic update in plain torch (HF trunk + linear head, core_algos value loss, AdamW), `epochs` passes
    over the mini-batches."""
    from mppo.core_algos import compute_value_loss

    params = [p for p in hf.model.parameters()] + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0)
    steps = []
    for start in [s for _ in range(epochs) for s in range(0, B, mini_batch_size)]:
        mb = {k: v[start:start + mini_batch_size] for k, v in batch.items()}
        vpreds = hf_values(hf, head, mb)
        loss, clipfrac = compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                            cliprange_value, loss_agg_mode)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad)
        opt.step()
        steps.append({"critic/vf_loss": loss.item(), "critic/vf_clipfrac": clipfrac.item(),
                      "critic/grad_norm": norm.item()})
    state = {k: v.detach().clone() for k, v in hf.model.state_dict().items()}
    state = {f"model.{k}": v for k, v in state.items()}
    state["score.weight"], state["score.bias"] = head.weight.detach().clone(), head.bias.detach().clone()
    return state, steps


def max_state_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max |got - ref| over the tensors both hold; raises if `got` misses one of ref's names."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise KeyError(f"exported weights miss {missing[:5]}")
    return max((got[k].float() - ref[k].float()).abs().max().item() for k in ref)


def mean_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = steps[0].keys()
    return {k: sum(s[k] for s in steps) / len(steps) for k in keys}


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def count_host_reads(counts: dict[str, int]):
    """Count the tensor -> host reads (.item(), .tolist(), float/int/bool of a tensor) made in the block: each is
    a device sync on a GPU."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    depth = [0]  # a torch function mode (mppo.parallel.cpu_compat) calls the method again: count the outer call

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            if depth[0] == 0:
                counts[name] = counts.get(name, 0) + 1
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
