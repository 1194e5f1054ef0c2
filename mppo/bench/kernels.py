"""`mppo bench kernels`: time and peak extra memory of hidden→log-prob+entropy, forward + backward.

Implementations: `naive` (full [N × V] fp32 logits, log_softmax + softmax entropy, as veRL's unfused path),
`torch` (mppo's chunked torch kernel), `triton` (mppo's Triton kernel, CUDA only) and `liger` (Liger-Kernel's
fused linear cross-entropy, CUDA only, where installed; it computes the log-prob but no entropy).

Every (implementation, N, H) case runs in a FRESH subprocess, so allocator caches and high-water marks never leak
from one case into the next. Memory method:
  * CPU: the process's peak resident set size (getrusage ru_maxrss, the kernel's high-water mark) minus the RSS
    measured after the inputs were created, minus the bytes of the gradients of the inputs (which every
    implementation must produce). glibc returns large blocks to the OS when freed, so RSS follows live tensors
    closely; it also counts any allocator slack, so it is an upper bound on what torch held.
  * CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() after the inputs, minus the gradients.
Time: wall clock of forward + backward of Σ a·log_prob + Σ b·entropy (random a, b), minimum over `--repeats`
runs after `--warmup` runs (CUDA synchronised). On CPU the table also shows the process CPU time of the same run
(all threads): on a shared machine it is disturbed far less by other processes than the wall clock.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Optional

FULL_CASES = [(1024, 512), (1024, 1024), (4096, 512), (4096, 1024)]
FULL_VOCAB = 151_936  # Qwen2 / Qwen2.5
QUICK_CASES = [(256, 64)]
QUICK_VOCAB = 8192
IMPLS = ("naive", "torch", "triton", "liger")


def _rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _impl_fn(impl: str):
    """A function (hidden, weight, labels) -> (log_probs, entropy or None) with autograd; imports happen here,
    before the memory baseline is taken."""
    if impl in ("naive", "torch", "triton"):
        from mppo.kernels import fused_linear_logprob_entropy
        if impl == "triton":
            from mppo.kernels import logprob_triton  # noqa: F401  (compile-time imports outside the timing)

        def run(hidden, weight, labels):
            return fused_linear_logprob_entropy(hidden, weight, labels, backend=impl)
        return run
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def run_liger(hidden, weight, labels):
            return -loss_fn(weight, hidden, labels).reshape(1), None  # Σ log p only: Liger has no entropy
        return run_liger
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def worker(impl: str, n: int, h: int, vocab: int, device: str, warmup: int, repeats: int) -> dict:
    """Run one case in this (fresh) process and return its measurements."""
    import torch
    run = _impl_fn(impl)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen) / h ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen).to(device)
    coef_lp = torch.randn(n, generator=gen).to(device)
    coef_ent = torch.randn(n, generator=gen).to(device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()

    times, cpu_times, lp_sum, ent_sum = [], [], 0.0, None
    for step in range(warmup + repeats):
        hidden.grad = weight.grad = None
        start, cpu_start = time.perf_counter(), time.process_time()
        lp, ent = run(hidden, weight, labels)
        loss = (lp * coef_lp).sum() if lp.numel() == n else lp.sum()
        if ent is not None:
            loss = loss + (ent * coef_ent).sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        lp_sum = float(lp.detach().double().sum())
        ent_sum = None if ent is None else float(ent.detach().double().sum())
    grad_bytes = sum(t.grad.numel() * t.grad.element_size() for t in (hidden, weight))
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"impl": impl, "n": n, "h": h, "vocab": vocab, "device": device,
            "dtype": str(dtype).replace("torch.", ""), "time_s": min(times), "cpu_s": min(cpu_times),
            "extra_bytes": peak - base - grad_bytes, "log_prob_sum": lp_sum, "entropy_sum": ent_sum}


def _available(impl: str, device: str) -> Optional[str]:
    """None if `impl` can run on `device`, else the reason it is skipped."""
    if impl in ("triton", "liger") and device != "cuda":
        return "GPU only"
    if impl == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return "liger-kernel not installed"
    return None


def _launch(impl: str, n: int, h: int, vocab: int, args) -> dict:
    cmd = [sys.executable, "-m", "mppo.bench.kernels", "--worker", impl, "--n", str(n), "--h", str(h),
           "--vocab", str(vocab), "--device", args.device, "--warmup", str(args.warmup),
           "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else dict(os.environ)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "n": n, "h": h, "error": f"timed out after {args.timeout:.0f}s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"impl": impl, "n": n, "h": h, "error": f"exit {proc.returncode}: {last[:120]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: list[dict]) -> str:
    header = (f"| {'impl':<7}| {'N':>5} | {'H':>5} | {'time s':>8} | {'time/naive':>10} | {'cpu s':>8} | "
              f"{'cpu/naive':>9} | {'extra MiB':>10} | {'mem/naive':>9} | {'Σlogp rel.diff':>14} |")
    lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    naive = {(r["n"], r["h"]): r for r in results if r["impl"] == "naive" and "error" not in r}
    for r in results:
        if "error" in r or "skipped" in r:
            note = r.get("error") or r["skipped"]
            lines.append(f"| {r['impl']:<7}| {r['n']:>5} | {r['h']:>5} | {note}")
            continue
        base = naive.get((r["n"], r["h"]))
        t_ratio = f"{r['time_s'] / base['time_s']:.2f}x" if base else "-"
        c_ratio = f"{r['cpu_s'] / base['cpu_s']:.2f}x" if base and base["cpu_s"] > 0 else "-"
        m_ratio = f"{r['extra_bytes'] / base['extra_bytes']:.3f}x" if base and base["extra_bytes"] > 0 else "-"
        diff = "-"
        if base:
            diff = f"{abs(r['log_prob_sum'] - base['log_prob_sum']) / abs(base['log_prob_sum']):.1e}"
        lines.append(f"| {r['impl']:<7}| {r['n']:>5} | {r['h']:>5} | {r['time_s']:>8.3f} | {t_ratio:>10} | "
                     f"{r['cpu_s']:>8.2f} | {c_ratio:>9} | {r['extra_bytes'] / 2 ** 20:>10.1f} | {m_ratio:>9} | "
                     f"{diff:>14} |")
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
        print(json.dumps(worker(args.worker, args.n, args.h, args.vocab, args.device, args.warmup, args.repeats)))
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
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
