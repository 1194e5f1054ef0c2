"""`mppo bench generation`: the CPU rollout engine against HF `generate`, same model, prompts, n and length.

    mppo bench generation [--hidden 128 --layers 4] [--prompts 8 --n 8 --length 64] [--threads 1,2] [--repeats 3]

Both sides sample (temperature 1, no top-k/top-p) exactly `--length` new tokens per sequence: the engine with
`ignore_eos`, HF with `min_new_tokens = max_new_tokens` (its EOS is masked until then). HF gets the prompts
left-padded in one batch with `num_return_sequences = n`, its default SDPA attention and KV cache. Runs are in
one process and alternate (mppo, HF, mppo, HF, ...) per thread count after one warm-up each, so both see the
same drift in machine load; the table gives medians over the repeats, new tokens per second of wall time, the
ratio, and CPU seconds (all threads of this process; with several threads CPU time includes the threads'
spin-waits, so it is no measure of work there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench generation", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128, help="random Qwen2 hidden size (128: ~0.9M parameters)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="countdown prompts")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--length", type=int, default=64, help="new tokens per sample (exact)")
    p.add_argument("--threads", default="1,2", help="comma list of torch intra-op thread counts")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and thread count")
    p.add_argument("--json", type=Path, default=None)
    return p


def _timed(fn: Callable[[], int]) -> dict[str, float]:
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = fn()
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start,
            "tokens": tokens}


def build_sides(opts: argparse.Namespace) -> tuple[Callable[[], int], Callable[[], int], dict[str, Any]]:
    """The two generation calls (each returns its number of new tokens) on the same model and prompts."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from mppo.bench.step import bench_assets
    from mppo.data import RLDataset, load_tokenizer
    from mppo.rollout import SamplingParams
    from mppo.rollout.cpu_engine import CPURolloutEngine

    assets = bench_assets(opts.hidden, opts.layers, 0.0)
    tokenizer = load_tokenizer(assets / "model")
    dataset = RLDataset(str(assets / "data" / "train.parquet"), tokenizer, max_prompt_length=512)
    prompts = [tokenizer(dataset[i].raw_prompt, add_special_tokens=False)["input_ids"] for i in range(opts.prompts)]
    model = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32).eval()
    engine = CPURolloutEngine(model.config)
    engine.update_weights(model.state_dict().items())
    sampling = SamplingParams(n=opts.n, max_new_tokens=opts.length, temperature=1.0,
                              stop_token_ids=[tokenizer.eos_token_id], ignore_eos=True)
    calls = {"step": 0}

    def mppo() -> int:
        calls["step"] += 1  # a new step each call: fresh samples, as in training
        responses = engine.generate(prompts, sampling, step=calls["step"])
        return sum(len(r.token_ids) for r in responses)

    longest = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    generation = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=opts.length,
                                  min_new_tokens=opts.length, num_return_sequences=opts.n, pad_token_id=pad,
                                  eos_token_id=tokenizer.eos_token_id)

    def hf() -> int:
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=attention_mask, generation_config=generation)
        return (out.shape[1] - longest) * out.shape[0]

    info = {"parameters": sum(p.numel() for p in model.parameters()), "prompt_lengths": [len(p) for p in prompts],
            "attn_implementation": model.config._attn_implementation}
    return mppo, hf, info


def measure(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    mppo, hf, info = build_sides(opts)
    results: dict[str, Any] = {"info": info, "threads": {}}
    for threads in [int(t) for t in opts.threads.split(",") if t.strip()]:
        torch.set_num_threads(threads)
        runs: dict[str, list[dict[str, float]]] = {"mppo": [], "hf": []}
        load_before = os.getloadavg()[0]
        mppo(), hf()  # warm-up
        for _ in range(opts.repeats):
            runs["mppo"].append(_timed(mppo))
            runs["hf"].append(_timed(hf))
        expected = opts.prompts * opts.n * opts.length
        for side, side_runs in runs.items():
            if any(r["tokens"] != expected for r in side_runs):
                raise RuntimeError(f"{side} generated {[r['tokens'] for r in side_runs]} tokens, not {expected}")
        results["threads"][threads] = {"runs": runs, "load": [load_before, os.getloadavg()[0]]}
    return results


def render(opts: argparse.Namespace, results: dict[str, Any]) -> str:
    info = results["info"]
    tokens = opts.prompts * opts.n * opts.length
    lines = [
        f"mppo bench generation: random Qwen2 (hidden {opts.hidden}, {opts.layers} layers, "
        f"{info['parameters'] / 1e6:.2f}M parameters, fp32), {opts.prompts} countdown prompts "
        f"({min(info['prompt_lengths'])}-{max(info['prompt_lengths'])} tokens) x {opts.n} samples x exactly "
        f"{opts.length} new tokens = {tokens} tokens; HF generate ({info['attn_implementation']} attention) vs the "
        f"mppo CPU engine, alternating, {opts.repeats} runs each after a warm-up; medians",
        "",
        f"{'threads':>7} {'mppo s':>8} {'HF s':>8} {'mppo tok/s':>11} {'HF tok/s':>10} {'mppo/HF':>8} "
        f"{'mppo CPU-s':>11} {'HF CPU-s':>9}  load before/after",
    ]
    for threads, entry in results["threads"].items():
        med = {side: {k: statistics.median(r[k] for r in runs) for k in ("seconds", "cpu_seconds")}
               for side, runs in entry["runs"].items()}
        ratio = med["hf"]["seconds"] / med["mppo"]["seconds"]
        lines.append(f"{threads:>7} {med['mppo']['seconds']:>8.3f} {med['hf']['seconds']:>8.3f} "
                     f"{tokens / med['mppo']['seconds']:>11.0f} {tokens / med['hf']['seconds']:>10.0f} "
                     f"{ratio:>7.2f}x {med['mppo']['cpu_seconds']:>11.3f} {med['hf']['cpu_seconds']:>9.3f}  "
                     f"{entry['load'][0]:.1f} / {entry['load'][1]:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    if min(opts.hidden, opts.layers, opts.prompts, opts.n, opts.length, opts.repeats) < 1:
        print("mppo bench generation: --hidden, --layers, --prompts, --n, --length and --repeats must be >= 1",
              file=sys.stderr)
        return 2
    results = measure(opts)
    print(render(opts, results))
    if opts.json:
        opts.json.write_text(json.dumps({"options": vars(opts) | {"json": str(opts.json)}, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
