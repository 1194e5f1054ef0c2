"""`mppo bench kernels`: time and peak extra memory of hidden → PPO loss, forward + backward, side by side.

Every implementation computes the actor's loss of N response tokens from their final hidden states — veRL's
vanilla PPO clip + entropy bonus (0.01) + KL loss (low_var_kl, 0.001), token-mean — and its gradients w.r.t.
hidden and the LM head:
  * `naive`: full [N × V] fp32 logits (log_softmax + softmax entropy), then core_algos — veRL's unfused path;
  * `torch`, `triton`: mppo's fused log-prob + entropy op (chunked, recomputes its logits in the backward:
    8·N·V·H FLOPs), then core_algos — the reference path of the actor;
  * `ppo-torch`, `ppo-triton`: mppo's fused PPO loss, gradient computed in the forward (6·N·V·H FLOPs) — what
    the actor runs for the loss modes it covers;
  * `liger`: Liger-Kernel's fused linear cross-entropy (CUDA, where installed): Σ log p only, no entropy and no
    PPO terms (its cost is the same 6·N·V·H matmuls; the baseline for the GPU target);
  * `liger-grpo`: Liger-Kernel's LigerFusedLinearGRPOLoss (where installed; pure torch, so CPU too): PPO clip +
    k3 KL (0.001), token-mean ("dapo"), one token per sequence so every token has its own advantage; no entropy
    bonus and no dual clip. Liger 0.8.5 recomputes each chunk's logits in its backward (8·N·V·H FLOPs).
`triton`, `ppo-triton` and `liger` need CUDA. The old / reference log-probs the loss needs come from a no-grad
pass before the measurement (the current log-probs plus noise, so ratios sit around 1 and the clip is active on
some tokens).

Every (implementation, N, H) case runs in a FRESH subprocess (mppo.bench.fresh_process), so allocator caches and
high-water marks never leak from one case into the next. Memory method:
  * CPU: the process's peak resident set size (getrusage ru_maxrss, the kernel's high-water mark) minus the RSS
    measured after the inputs were created, minus the bytes of the gradients of the inputs (which every
    implementation must produce). glibc returns large blocks to the OS when freed, so RSS follows live tensors
    closely; it also counts any allocator slack, so it is an upper bound on what torch held.
  * CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() after the inputs, minus the gradients.
Time: wall clock of forward + backward, minimum over `--repeats` runs after `--warmup` runs (CUDA synchronised).
On CPU the table also shows the process CPU time of the same run (all threads): on a shared machine it is
disturbed far less by other processes than the wall clock. `vs recompute` is the time (CPU time on CPU) of a
fused PPO loss over the fused log-prob op of the same backend.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from mppo.bench.fresh_process import peak_rss_bytes, run_case, write_results

FULL_CASES = [(1024, 512), (1024, 1024), (4096, 512), (4096, 1024)]
FULL_VOCAB = 151_936  # Qwen2 / Qwen2.5
QUICK_CASES = [(256, 64)]
QUICK_VOCAB = 8192
IMPLS = ("naive", "torch", "ppo-torch", "triton", "ppo-triton", "liger", "liger-grpo")
OTHER_LOSS = ("liger", "liger-grpo")  # compute a different loss: no loss comparison with naive
RECOMPUTE_OF = {"ppo-torch": "torch", "ppo-triton": "triton"}  # the reference path each fused loss replaces
LOSS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.01, kl_loss_coef=0.001,
            kl_loss_type="low_var_kl")


def _rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _reference_loss(log_probs, entropy, data):
    """core_algos' actor loss of one row of N tokens (what ActorWorker's reference path computes)."""
    from mppo.core_algos import PolicyLossParams, agg_loss, compute_policy_loss_vanilla, kl_penalty

    lp, ent = log_probs[None], entropy[None]
    mask = data["mask"][None]
    params = PolicyLossParams(clip_ratio_low=LOSS["clip_ratio_low"], clip_ratio_high=LOSS["clip_ratio_high"])
    pg_loss, _ = compute_policy_loss_vanilla(data["old"][None], lp, data["adv"][None], mask, "token-mean",
                                             config=params)
    kl_loss = agg_loss(kl_penalty(lp, data["ref"][None], LOSS["kl_loss_type"]), mask, "token-mean")
    return pg_loss - LOSS["entropy_coeff"] * agg_loss(ent, mask, "token-mean") + LOSS["kl_loss_coef"] * kl_loss


def _impl_fn(impl: str, chunk_rows: Optional[int]):
    """A function (hidden, weight, labels, data) -> scalar loss with autograd; imports happen here, before the
    memory baseline is taken."""
    if impl in ("naive", "torch", "triton"):
        from mppo.kernels import fused_linear_logprob_entropy
        if impl == "triton":
            from mppo.kernels import logprob_triton  # noqa: F401  (compile-time imports outside the timing)

        def run(hidden, weight, labels, data):
            lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, backend=impl)
            return _reference_loss(lp, ent, data)
        return run
    if impl in ("ppo-torch", "ppo-triton"):
        from mppo.kernels import PPOTokenLoss, fused_linear_ppo_loss
        backend = impl.split("-")[1]
        if backend == "triton":
            from mppo.kernels import logprob_triton  # noqa: F401,F811

        def run_fused(hidden, weight, labels, data):
            spec = PPOTokenLoss(advantages=data["adv"], weights=data["mask"] / data["mask"].sum(), mask=data["mask"],
                                old_log_prob=data["old"], ref_log_prob=data["ref"], **LOSS)
            return fused_linear_ppo_loss(hidden, weight, labels, spec, chunk_rows=chunk_rows, backend=backend).loss
        return run_fused
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def run_liger(hidden, weight, labels, data):
            return loss_fn(weight, hidden, labels)  # −Σ log p only: Liger has no entropy or PPO terms here
        return run_liger
    if impl == "liger-grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        # chunk_size = rows: one chunk of N one-token sequences (Liger chunks over sequences; its log-prob op
        # chunks rows and vocabulary inside)
        grpo = LigerFusedLinearGRPOLoss(beta=LOSS["kl_loss_coef"], compiled=False, use_ref_model=True,
                                        chunk_size=1 << 30, epsilon_low=LOSS["clip_ratio_low"],
                                        epsilon_high=LOSS["clip_ratio_high"], loss_type="dapo")

        def run_liger_grpo(hidden, weight, labels, data):
            n = hidden.shape[0]
            loss, _metrics = grpo(hidden.view(n, 1, -1), weight, labels.view(n, 1), data["mask"].view(n, 1),
                                  data["adv"], ref_per_token_logps=data["ref"].view(n, 1),
                                  old_per_token_logps=data["old"].view(n, 1))
            return loss
        return run_liger_grpo
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def worker(impl: str, n: int, h: int, vocab: int, device: str, warmup: int, repeats: int,
           chunk_rows: Optional[int] = None) -> dict:
    """Run one case in this (fresh) process and return its measurements."""
    import torch

    from mppo.kernels import fused_linear_logprob_entropy
    run = _impl_fn(impl, chunk_rows)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen) / h ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen).to(device)
    with torch.no_grad():  # old / reference log-probs: the current ones plus noise (chunked: no [N × V] here)
        current, _ = fused_linear_logprob_entropy(hidden, weight, labels, compute_entropy=False,
                                                  backend="torch" if device == "cpu" else "triton")
    data = {"old": current + 0.2 * torch.randn(n, generator=gen).to(device),
            "ref": current + 0.2 * torch.randn(n, generator=gen).to(device),
            "adv": torch.randn(n, generator=gen).to(device), "mask": torch.ones(n, device=device)}
    del current
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()

    times, cpu_times, loss_value = [], [], 0.0
    for step in range(warmup + repeats):
        hidden.grad = weight.grad = None
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = run(hidden, weight, labels, data)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        loss_value = float(loss.detach().double())
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in (hidden, weight))
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss_bytes()
    return {"impl": impl, "n": n, "h": h, "vocab": vocab, "device": device,
            "dtype": str(dtype).replace("torch.", ""), "time_s": min(times), "cpu_s": min(cpu_times),
            "extra_bytes": peak - base - grad_bytes, "loss": loss_value, "chunk_rows": chunk_rows}


def _available(impl: str, device: str) -> Optional[str]:
    """None if `impl` can run on `device`, else the reason it is skipped."""
    if impl in ("triton", "ppo-triton", "liger") and device != "cuda":
        return "GPU only"
    if impl in ("liger", "liger-grpo"):
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "liger-kernel not installed"
    return None


def _launch(impl: str, n: int, h: int, vocab: int, args) -> dict:
    worker_args = [impl, "--n", str(n), "--h", str(h), "--vocab", str(vocab), "--device", args.device,
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    worker_args += ["--chunk-rows", str(args.chunk_rows)] if args.chunk_rows else []
    return run_case("mppo.bench.kernels", worker_args, case={"impl": impl, "n": n, "h": h}, timeout=args.timeout,
                    threads=args.threads)


def _table(results: list[dict], device: str) -> str:
    header = (f"| {'impl':<10}| {'N':>5} | {'H':>5} | {'time s':>8} | {'time/naive':>10} | {'cpu s':>8} | "
              f"{'cpu/naive':>9} | {'vs recompute':>12} | {'extra MiB':>10} | {'mem/naive':>9} | "
              f"{'loss rel.diff':>13} |")
    lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    by_case = {(r["impl"], r["n"], r["h"]): r for r in results if "error" not in r and "skipped" not in r}
    clock = "time_s" if device == "cuda" else "cpu_s"
    for r in results:
        if "error" in r or "skipped" in r:
            note = r.get("error") or r["skipped"]
            lines.append(f"| {r['impl']:<10}| {r['n']:>5} | {r['h']:>5} | {note}")
            continue
        base = by_case.get(("naive", r["n"], r["h"]))
        recompute = by_case.get((RECOMPUTE_OF.get(r["impl"], ""), r["n"], r["h"]))
        t_ratio = f"{r['time_s'] / base['time_s']:.2f}x" if base else "-"
        c_ratio = f"{r['cpu_s'] / base['cpu_s']:.2f}x" if base and base["cpu_s"] > 0 else "-"
        vs = f"{r[clock] / recompute[clock]:.2f}x" if recompute and recompute[clock] > 0 else "-"
        m_ratio = f"{r['extra_bytes'] / base['extra_bytes']:.3f}x" if base and base["extra_bytes"] > 0 else "-"
        diff = "-"
        if base and r["impl"] not in OTHER_LOSS:
            diff = f"{abs(r['loss'] - base['loss']) / max(abs(base['loss']), 1e-12):.1e}"
        lines.append(f"| {r['impl']:<10}| {r['n']:>5} | {r['h']:>5} | {r['time_s']:>8.3f} | {t_ratio:>10} | "
                     f"{r['cpu_s']:>8.2f} | {c_ratio:>9} | {vs:>12} | {r['extra_bytes'] / 2 ** 20:>10.1f} | "
                     f"{m_ratio:>9} | {diff:>13} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: N,H={QUICK_CASES}, V={QUICK_VOCAB}")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--cases", default=None, help="override N×H cases, e.g. '1024x512,4096x1024'")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary size (default {FULL_VOCAB})")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per case (default 1 CPU, 3 CUDA)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case, min reported (default 1/10)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the workers")
    p.add_argument("--chunk-rows", type=int, default=None,
                   help="rows per logits chunk of the fused PPO loss (default: ~128 MiB of fp32 logits)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per case before it is reported failed")
    p.add_argument("--json", default=None, help="also write the raw results to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--h", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "auto":
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.repeats = args.repeats if args.repeats is not None else (10 if cuda else 1)
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.h, args.vocab, args.device, args.warmup, args.repeats,
                                args.chunk_rows)))
        return 0

    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        print(f"unknown implementation(s) {unknown}; choose from {IMPLS}", file=sys.stderr)
        return 2
    if args.cases:
        cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.cases.split(",")]
    else:
        cases = QUICK_CASES if args.quick else FULL_CASES
    vocab = args.vocab or (QUICK_VOCAB if args.quick else FULL_VOCAB)
    threads = args.threads or os.environ.get("OMP_NUM_THREADS", "default")
    print(f"mppo bench kernels: device={args.device}, V={vocab}, dtype={'bf16' if cuda else 'fp32'}, "
          f"warmup={args.warmup}, repeats={args.repeats}, threads={threads}", flush=True)
    results = []
    for n, h in cases:
        for impl in impls:
            reason = _available(impl, args.device)
            if reason:
                results.append({"impl": impl, "n": n, "h": h, "skipped": reason})
                continue
            r = _launch(impl, n, h, vocab, args)
            results.append(r)
            status = r.get("error") or f"{r['time_s']:.3f}s, extra {r['extra_bytes'] / 2 ** 20:.1f} MiB"
            print(f"  {impl:<6} N={n:<5} H={h:<5} {status}", flush=True)
    print(_table(results, args.device))
    write_results(args.json, results)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
