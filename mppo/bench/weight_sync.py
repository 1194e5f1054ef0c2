"""`mppo bench weight-sync`: bytes/s of the whole actor -> rollout engine sync against this machine's memcpy.

A random Qwen2-architecture megatron actor (fp32, a few hundred MB) is built on TP x PP CPU ranks (gloo) that this
command spawns itself; global rank 0 holds a CPURolloutEngine. One sync is
`mppo.rollout.weight_sync.push_actor_weights`: with gloo ranks on one host, every rank writes its shards in HF
layout into rank 0's shared-memory staging buffer (mppo.models.weight_transport) and the engine keeps the staged
tensors as its weights. Its rate (model bytes / wall seconds, median over --repeats) is set against memcpy
bandwidth (bytes copied / second by a large tensor copy_), measured on rank 0 between the repeats (so under the
same load) with one thread and with all threads.

Where the time goes: the staged export alone (no engine), the engine's load when it must copy (tensors already in
memory), and the same export by gloo collectives, to rank 0 and (--collective-all) to every rank as before staging.

With SGLang installed (`--sglang`, on by default when it is), rank 0 also starts a real sglang.Engine (SGLang's
CPU tier, engine TP 1) and the same sync is timed into it: the staged export, then SGLangRolloutEngine's
flattened-bucket session (each bucket flattened into a fresh buffer, handed to SGLang's scheduler process as
shared-memory tensors, loaded into its parameters).

With `--lora-rank R` (and SGLang), LoRA adapters of rank R on every linear are attached to the actor afterwards and
the two LoRA syncs are timed into one sglang.Engine started with SGLang's LoRA support (its torch-native backend
on the CPU): merged (base + adapters, the whole model, lora.merge=true) and adapters only (lora.merge=false:
mppo.rollout.weight_sync.push_actor_adapters after the base is in). Adapters cost at generation instead: the
same greedy batch is timed on that engine (base + the adapter) and on the plain engine above (merged weights).

The CPU path only (CUDA is hidden from the ranks): on GPUs the sync is NCCL and SGLang's CUDA-IPC path, not this one.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench weight-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--ffn", type=int, default=None, help="intermediate size (default: 2.75 x hidden, rounded to 64)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--bucket-mb", type=int, default=256, help="exporter bucket size in MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch intra-op threads in each rank")
    p.add_argument("--memcpy-mb", type=int, default=512, help="size of the tensor copied to measure memcpy")
    p.add_argument("--collective-all", action="store_true",
                   help="also time the export to every rank by collectives (the transport before staging; slow)")
    p.add_argument("--sglang", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the sync into a real sglang.Engine on CPU (default: when SGLang is installed)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also compare LoRA's merged and adapter-only syncs into SGLang at this rank (0: off)")
    p.add_argument("--json", type=Path, default=None, help="also write the measurements to this file")
    return p


def model_config(args: argparse.Namespace) -> dict:
    """An HF config.json dict for a Qwen2-architecture model (untied head, so the output layer is synced too)."""
    ffn = args.ffn or (int(args.hidden * 2.75) + 63) // 64 * 64
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--hidden {args.hidden} must be divisible by --heads {args.heads}, and --heads by "
                         f"--kv-heads {args.kv_heads}")
    if args.kv_heads % args.tp or args.layers % args.pp:
        raise ValueError(f"--tp {args.tp} must divide --kv-heads {args.kv_heads} and --pp {args.pp} must divide "
                         f"--layers {args.layers}")
    return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=args.vocab,
                hidden_size=args.hidden, intermediate_size=ffn, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, hidden_act="silu",
                max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                use_sliding_window=False, torch_dtype="float32", eos_token_id=None, bos_token_id=None)


# ------------------------------------------------------------------------------------------------ memcpy
def _cpu_threads() -> int:
    """The cores this process may run on (its affinity mask, which containers narrow), else os.cpu_count()."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def memcpy_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Bytes copied per second by `dst.copy_(src)` of an nbytes fp32 tensor with `threads` intra-op threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4)  # filled, so every page is resident before timing
        dst = torch.zeros_like(src)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times)
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ ranks
def _timed(fn) -> float:
    """Wall seconds of a collective step, from the barrier before it to the barrier after it."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def rank_main(rank: int, world: int, port: int, opts: dict, out_file: str) -> None:
    """One spawned rank: build the actor, then per repeat: the whole sync, the export alone (staged and by
    collectives), the engine's copy of tensors already in memory, and memcpy (rank 0, while the others wait).
    Rank 0 writes the timings."""
    # CUDA_VISIBLE_DEVICES: CUDA initialises lazily, so this keeps init_distributed on gloo/CPU on a GPU machine
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    import torch

    torch.set_num_threads(opts["threads_per_rank"])
    import torch.distributed as dist

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weight_transport import release_staging_buffers
    from mppo.models.weights import bucketed, iter_hf_weights
    from mppo.parallel import init_distributed
    from mppo.rollout.weight_sync import push_actor_weights

    dims = init_distributed(opts["tp"], opts["pp"], seed=0)
    args = read_hf_config(opts["config"])
    chunks = build_gpt_model(args, dims, role="actor")
    bucket = opts["bucket_mb"] << 20
    engine, held = None, {}
    if rank == 0:
        from transformers import Qwen2Config

        from mppo.rollout.cpu_engine import CPURolloutEngine

        engine = CPURolloutEngine(Qwen2Config(**opts["config"]))
    push_actor_weights(engine, chunks, args, bucket)  # warm-up: sets up the staging buffer, first page touches
    if rank == 0:  # the same stream already in private memory, for the engine-only (copying) timing
        held = {name: tensor.clone() for name, tensor in engine.state_dict().items()}

    last: dict = {}

    def sync() -> None:
        last["stats"] = push_actor_weights(engine, chunks, args, bucket)

    def drain(**kwargs) -> None:
        for _ in iter_hf_weights(chunks, args, destinations=[0], **kwargs):
            pass

    rows: dict[str, list[float]] = {k: [] for k in ("sync", "export", "collective", "collective_all", "load",
                                                     "sglang")}
    memcpy: dict[str, list[float]] = {"1": [], "all": []}
    nbytes = 0
    for _ in range(opts["repeats"]):
        rows["sync"].append(_timed(sync))
        nbytes = last["stats"].bytes
        rows["export"].append(_timed(drain))
        rows["collective"].append(_timed(lambda: drain(transport="collective")))
        if opts["collective_all"]:
            rows["collective_all"].append(_timed(lambda: [None for _ in iter_hf_weights(chunks, args)]))
        if rank == 0:
            start = time.perf_counter()
            engine.update_weights(bucketed(held.items(), bucket))
            rows["load"].append(time.perf_counter() - start)
            memcpy["1"].append(memcpy_bandwidth(opts["memcpy_mb"] << 20, 1))
            memcpy["all"].append(memcpy_bandwidth(opts["memcpy_mb"] << 20, _cpu_threads()))
        dist.barrier()
    sync()  # the engine ends on synced weights, as a trainer's would
    lora: dict = {}
    if opts["sglang"]:
        rows["sglang"], greedy_merged = _time_sglang(rank, chunks, args, bucket, opts)
        if opts["lora_rank"] > 0:
            lora = _time_sglang_lora(rank, chunks, args, bucket, opts, greedy_merged)
    if rank == 0:
        Path(out_file).write_text(json.dumps({
            "bytes": nbytes, "raw_seconds": rows, "raw_memcpy_Bps": memcpy, "lora": lora,
            "seconds": {k: statistics.median(v) for k, v in rows.items() if v},
            "memcpy_Bps": {k: statistics.median(v) for k, v in memcpy.items()}}))
    engine = held = None  # drop the engine's staged weights before the buffers
    release_staging_buffers()
    dist.barrier()
    dist.destroy_process_group()


def _time_sglang(rank: int, chunks, args, bucket: int, opts: dict) -> tuple[list[float], list[float]]:
    """Seconds of each repeat of the whole sync into a real sglang.Engine on rank 0 (after one warm-up sync); with
    --lora-rank also of one greedy batch on it (the engine a merged LoRA sync feeds; rank 0 only, else [])."""
    import torch.distributed as dist

    from mppo.rollout.weight_sync import push_actor_weights

    engine = None
    if rank == 0:
        from mppo.rollout.sglang_engine import SGLangRolloutEngine

        model_dir = Path(opts["tmp"]) / "sglang_model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(opts["config"]))  # SGLang reads only the config
        engine = SGLangRolloutEngine(str(model_dir), gpu_memory_utilization=0.3, dtype="float32", on_cpu=True,
                                     max_total_tokens=4096, log_path=Path(opts["tmp"]) / "sglang.log",
                                     name="the benchmark's engine")
    dist.barrier()
    push_actor_weights(engine, chunks, args, bucket)  # warm-up
    seconds = [_timed(lambda: push_actor_weights(engine, chunks, args, bucket)) for _ in range(opts["repeats"])]
    greedy: list[float] = []
    if engine is not None:
        if opts["lora_rank"] > 0:  # no LoRA support: what the merged weights cost per generated batch
            greedy = _greedy_seconds(engine, opts)
        engine.shutdown()
    return seconds, greedy


def _greedy_seconds(engine, opts: dict) -> list[float]:
    """Seconds of each repeat of one greedy batch (8 prompts x 16 tokens -> 32 new tokens each), after a warm-up."""
    from mppo.rollout import SamplingParams

    prompts = [[(7 * i + j) % opts["config"]["vocab_size"] for j in range(16)] for i in range(8)]
    greedy = SamplingParams(do_sample=False, max_new_tokens=32, ignore_eos=True)
    engine.generate(prompts, greedy, step=0)
    times = []
    for _ in range(opts["repeats"]):
        start = time.perf_counter()
        engine.generate(prompts, greedy, step=0)
        times.append(time.perf_counter() - start)
    return times


GREEDY_TOKENS = 8 * 32


def _time_sglang_lora(rank: int, chunks, args, bucket: int, opts: dict, greedy_merged: list[float]) -> dict:
    """LoRA of rank --lora-rank on every linear of the actor, one sglang.Engine with LoRA support on rank 0: the
    seconds of each repeat of the merged sync and of the adapter-only sync, their bytes, and the seconds of one
    greedy batch on base + the adapter beside `greedy_merged` (the plain engine's, on merged weights)."""
    import torch.distributed as dist

    from mppo.config.lora import HF_PROJECTIONS
    from mppo.models.lora import LoRASpec, adapters_disabled, apply_lora, iter_adapters
    from mppo.rollout.weight_sync import push_actor_adapters, push_actor_weights

    spec = LoRASpec(rank=opts["lora_rank"], alpha=2.0 * opts["lora_rank"], dropout=0.0, projections=HF_PROJECTIONS)
    apply_lora(chunks, args, spec)
    for adapters in iter_adapters(chunks):  # B = 0 at the start would make the merge a no-op: give it values
        for b in adapters.lora_B.values():
            b.data.normal_(0.0, 0.01)
    engine = None
    if rank == 0:
        from mppo.rollout.sglang_engine import SGLangRolloutEngine

        model_dir = Path(opts["tmp"]) / "sglang_model"
        engine = SGLangRolloutEngine(str(model_dir), gpu_memory_utilization=0.3, dtype="float32", on_cpu=True,
                                     max_total_tokens=4096, log_path=Path(opts["tmp"]) / "sglang_lora.log",
                                     name="the benchmark's LoRA engine",
                                     lora={"rank": spec.rank, "target_modules": list(spec.projections)})
    dist.barrier()
    push_actor_adapters(engine, chunks, args, bucket)  # warm-up: the base goes in, then the adapters
    last: dict = {}

    def adapters_only() -> None:
        last["adapters"] = push_actor_adapters(engine, chunks, args, bucket)

    def merged() -> None:
        last["merged"] = push_actor_weights(engine, chunks, args, bucket)

    seconds = {"merged": [_timed(merged) for _ in range(opts["repeats"])]}
    with adapters_disabled(chunks):  # the base again (the merged weights were pushed over it), then the adapter
        push_actor_weights(engine, chunks, args, bucket)
    push_actor_adapters(engine, chunks, args, bucket)
    seconds["adapters"] = [_timed(adapters_only) for _ in range(opts["repeats"])]
    generation: dict = {}
    if engine is not None:
        generation["adapter"] = _greedy_seconds(engine, opts)
        generation["merged"] = greedy_merged
        engine.shutdown()
    dist.barrier()
    return {"rank": spec.rank, "seconds": seconds, "generate_seconds": generation,
            "bytes": {k: v.bytes for k, v in last.items()}}


# ------------------------------------------------------------------------------------------------ report
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render(result: dict, all_threads: int) -> str:
    """The table: median seconds per phase, its rate, and that rate over memcpy (1 thread, all threads)."""
    nbytes, sec = result["bytes"], result["seconds"]
    mem1, mem_all = result["memcpy_Bps"]["1"], result["memcpy_Bps"]["all"]

    def rate_cols(rate: float) -> str:
        return f" {rate / GB:>8.2f} {rate / mem1:>9.0%} {rate / mem_all:>11.0%}"

    def line(label: str, key: str, nb: int | None = nbytes) -> str:
        if key not in sec:
            return f"{label:<46} {'-':>8}"
        return f"{label:<46} {sec[key]:>8.3f}" + (rate_cols(nb / sec[key]) if nb else "")

    head = (f"{'phase (median over repeats)':<46} {'seconds':>8} {'GB/s':>8} {'vs 1 thr':>9} "
            f"{f'vs {all_threads} thr':>11}")
    lines = [head, "-" * len(head),
             line("whole sync: push_actor_weights -> engine", "sync"),
             line("  export only, shared-memory staging (auto)", "export"),
             line("  engine load by copying (stream in RAM)", "load"),
             line("export to rank 0 by gloo collectives", "collective"),
             line("export to every rank by gloo collectives", "collective_all"),
             line("whole sync into a real sglang.Engine (CPU, TP 1)", "sglang")]
    return "\n".join(lines)


def render_lora(lora: dict) -> str:
    """LoRA's two syncs into SGLang (medians), and what the adapters cost per generated batch."""
    sec = {k: statistics.median(v) for k, v in lora["seconds"].items()}
    gen = {k: statistics.median(v) for k, v in lora["generate_seconds"].items()}
    nb = lora["bytes"]
    lines = [f"LoRA rank {lora['rank']} on every linear, one sglang.Engine with LoRA support (CPU, torch_native):",
             f"  {'merged sync (lora.merge=true)':<40} {sec['merged']:>8.3f} s {nb['merged'] / 2 ** 20:>9.1f} MiB",
             f"  {'adapters-only sync (lora.merge=false)':<40} {sec['adapters']:>8.3f} s "
             f"{nb['adapters'] / 2 ** 20:>9.1f} MiB  (speed-up {sec['merged'] / sec['adapters']:.2f}x, "
             f"{nb['merged'] / nb['adapters']:.0f}x fewer bytes)"]
    if gen:
        lines.append(f"  greedy batch ({GREEDY_TOKENS} new tokens): base + adapter {gen['adapter']:.3f} s, merged "
                     f"weights (an engine without LoRA) {gen['merged']:.3f} s ({gen['adapter'] / gen['merged']:.2f}x); "
                     f"adapters-only saves {sec['merged'] - sec['adapters']:.3f} s per sync and costs "
                     f"{gen['adapter'] - gen['merged']:.3f} s per such batch")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    try:
        if min(opts.tp, opts.pp, opts.repeats, opts.bucket_mb, opts.threads_per_rank, opts.memcpy_mb) < 1:
            raise ValueError("--tp, --pp, --repeats, --bucket-mb, --threads-per-rank and --memcpy-mb must be >= 1")
        if opts.lora_rank < 0:
            raise ValueError(f"--lora-rank {opts.lora_rank}: must be >= 0 (0: no LoRA comparison)")
        config = model_config(opts)
    except ValueError as err:
        print(f"mppo bench weight-sync: {err}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    all_threads = _cpu_threads()
    world = opts.tp * opts.pp
    if opts.sglang is None:
        import importlib.util

        opts.sglang = importlib.util.find_spec("sglang") is not None
    with tempfile.TemporaryDirectory() as tmp:
        rank_opts = dict(tp=opts.tp, pp=opts.pp, bucket_mb=opts.bucket_mb, repeats=opts.repeats,
                         threads_per_rank=opts.threads_per_rank, memcpy_mb=opts.memcpy_mb, config=config,
                         collective_all=opts.collective_all, sglang=opts.sglang, tmp=tmp,
                         lora_rank=opts.lora_rank)
        out_file = str(Path(tmp) / "rank0.json")
        mp.start_processes(rank_main, args=(world, _free_port(), rank_opts, out_file), nprocs=world,
                           start_method="spawn")
        result = json.loads(Path(out_file).read_text())
    mem1, mem_all = result["memcpy_Bps"]["1"], result["memcpy_Bps"]["all"]
    print(f"mppo bench weight-sync: Qwen2 architecture, hidden {opts.hidden}, {opts.layers} layers, ffn "
          f"{config['intermediate_size']}, heads {opts.heads}/{opts.kv_heads}, vocab {opts.vocab}, fp32, untied "
          f"head: {result['bytes'] / 2 ** 20:.1f} MiB per sync")
    print(f"layout: tp {opts.tp} x pp {opts.pp} = {world} ranks (gloo, {opts.threads_per_rank} thread(s) each), "
          f"CPURolloutEngine{' and a sglang.Engine' if opts.sglang else ''} on rank 0, bucket {opts.bucket_mb} MiB, "
          f"{opts.repeats} repeats")
    print(f"memcpy on rank 0 between repeats (copy_ of {opts.memcpy_mb} MiB; bytes copied/s): "
          f"1 thread {mem1 / GB:.2f} GB/s, {all_threads} threads {mem_all / GB:.2f} GB/s\n")
    print(render(result, all_threads))
    rate = result["bytes"] / result["seconds"]["sync"]
    print(f"\nwhole sync: {rate / GB:.2f} GB/s = {rate / mem1:.0%} of 1-thread memcpy, {rate / mem_all:.0%} of "
          f"{all_threads}-thread memcpy (goal >= 50%)")
    if "sglang" in result["seconds"]:
        rate = result["bytes"] / result["seconds"]["sglang"]
        print(f"whole sync into SGLang (CPU tier, engine TP 1): {rate / GB:.2f} GB/s = {rate / mem1:.0%} of 1-thread "
              f"memcpy, {rate / mem_all:.0%} of {all_threads}-thread memcpy")
    if result.get("lora"):
        print("\n" + render_lora(result["lora"]))
    elif opts.lora_rank > 0:
        print("\n--lora-rank needs SGLang (the adapter-only sync goes into its LoRA support): not measured")
    if opts.json:
        opts.json.write_text(json.dumps({**result, "all_threads": all_threads, "options": rank_opts}, indent=1))
    return 0
