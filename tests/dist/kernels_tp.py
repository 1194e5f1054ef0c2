"""Vocab-parallel fused log-prob/entropy under torchrun (gloo): every case compares this rank's results with an
unsharded float64 reference computed locally from the full weight. Writes OUT/rank{R}.json: case -> max errors.

Run by tests/test_kernels_tp.py through dist_util.run_torchrun (2 ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mppo.kernels import fused_linear_logprob_entropy, fused_linear_ppo_loss
from mppo.kernels.reference import naive_linear_logprob_entropy
from mppo.parallel import cpu_compat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the fused PPO loss's reference
from test_kernels_ppo import GLOBAL_INFO, Knobs, make_problem, reference, spec_for  # noqa: E402


def _case(name, results, *, backend, n, hidden_size, local_vocab, temperature=1.0, valid=None, chunk=None,
          dtype=torch.float32, compute_entropy=True, group=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234)  # same full problem on every rank
    full_vocab = local_vocab * world
    hidden = torch.randn(n, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(full_vocab, hidden_size, generator=gen) * 0.5).to(dtype)
    valid_v = valid or full_vocab
    labels = torch.randint(0, valid_v, (n,), generator=gen)
    seam = [min(local_vocab - 1, valid_v - 1), min(local_vocab, valid_v - 1)]  # last of shard 0, first of shard 1
    labels[:4] = torch.tensor([0, valid_v - 1, *seam])
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)

    h = hidden.clone().requires_grad_()
    w = weight[rank * local_vocab:(rank + 1) * local_vocab].clone().requires_grad_()
    lp, ent = fused_linear_logprob_entropy(h, w, labels, temperature=temperature, tp_group=group, chunk_size=chunk,
                                           compute_entropy=compute_entropy, valid_vocab_size=valid, backend=backend)
    loss = lp.double() @ g_lp + (ent.double() @ g_ent if compute_entropy else 0.0)
    loss.backward()

    h_ref = hidden.double().requires_grad_()
    w_ref = weight.double().requires_grad_()
    lp_ref, ent_ref = naive_linear_logprob_entropy(h_ref, w_ref, labels, temperature=temperature,
                                                   valid_vocab_size=valid, compute_entropy=compute_entropy)
    (lp_ref @ g_lp + (ent_ref @ g_ent if compute_entropy else 0.0)).backward()
    w_ref_grad = w_ref.grad[rank * local_vocab:(rank + 1) * local_vocab]

    def err(a, b):
        return float((a.detach().double() - b.detach()).abs().max() / (b.detach().abs().max() + 1e-12))

    out = {"log_prob": err(lp, lp_ref), "grad_hidden": err(h.grad, h_ref.grad), "grad_weight": err(w.grad, w_ref_grad)}
    if compute_entropy:
        out["entropy"] = err(ent, ent_ref)
    else:
        out["entropy_is_none"] = float(ent is None)
    with torch.no_grad():  # forward-only path (old / reference log-probs) must agree too and keep no graph
        lp_ng, _ = fused_linear_logprob_entropy(hidden, weight[rank * local_vocab:(rank + 1) * local_vocab], labels,
                                                temperature=temperature, tp_group=group, chunk_size=chunk,
                                                valid_vocab_size=valid, backend=backend)
    out["no_grad_log_prob"] = err(lp_ng, lp_ref)
    out["no_grad_has_graph"] = float(lp_ng.grad_fn is not None)
    results[name] = out


def _ppo_case(name, results, *, backend, local_vocab, valid=None, dtype=torch.float32, group=None, **knobs):
    """The fused PPO loss with this rank's vocab shard vs the unsharded float64 reference path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = Knobs(valid_vocab=valid, **knobs)
    p = make_problem(b=5, t=9, h=24, vocab=local_vocab * world, valid_vocab=valid, seed=21, dtype=dtype,
                     temperature=k.temperature)  # the same problem on every rank
    rows = slice(rank * local_vocab, (rank + 1) * local_vocab)
    h = p.hidden.clone().requires_grad_()
    w = p.weight[rows].clone().requires_grad_()
    out = fused_linear_ppo_loss(h, w, p.labels, spec_for(p, k), temperature=k.temperature, tp_group=group,
                                valid_vocab_size=valid, chunk_rows=13, block_cols=40, backend=backend)
    out.loss.backward()
    loss, stats, lp, ent, grad_h, grad_w = reference(
        type(p)(**{**vars(p), "hidden": p.hidden.double(), "weight": p.weight.double()}), k)

    def err(a, b):
        return float((a.detach().double() - b).abs().max() / (b.abs().max() + 1e-12))

    results[name] = {"loss": err(out.loss, loss), "stats": err(out.stats, stats), "log_prob": err(out.log_probs, lp),
                     "entropy": err(out.entropy, ent), "grad_hidden": err(h.grad, grad_h),
                     "grad_weight": err(w.grad, grad_w[rows]), "no_grad_has_graph": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    group = dist.new_group(list(range(dist.get_world_size())))
    results: dict[str, dict] = {}
    common = dict(n=37, hidden_size=24, local_vocab=53, group=group)
    _case("torch_basic", results, backend="torch", **common)
    _case("torch_temp_chunked", results, backend="torch", temperature=0.7, chunk=16, **common)
    _case("torch_padded_vocab", results, backend="torch", valid=90, chunk=20, **common)
    _case("torch_padded_empty_shard", results, backend="torch", valid=40, **common)  # rank 1 holds only padding
    _case("torch_no_entropy", results, backend="torch", compute_entropy=False, **common)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _case("triton_padded", results, backend="triton", temperature=1.3, valid=100, **common)
    ppo = dict(local_vocab=53, group=group)
    _ppo_case("ppo_torch", results, backend="torch", mode="seq-mean-token-mean", info=GLOBAL_INFO,
              temperature=0.8, **ppo)
    _ppo_case("ppo_torch_padded_empty_shard", results, backend="torch", valid=40, on_policy=True, **ppo)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _ppo_case("ppo_triton_padded", results, backend="triton", valid=100, kl_type="k2", **ppo)
    # megatron's TP mappings allocate on CUDA; on CPU they need the compat layer that init_distributed installs
    cpu_compat.install()
    _case("naive_megatron_mappings", results, backend="naive", temperature=0.9, valid=100, **common)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
