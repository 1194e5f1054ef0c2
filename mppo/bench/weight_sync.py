"""`mppo bench weight-sync`: bytes/s of the whole actor -> rollout engine sync against this machine's memcpy.

A random Qwen2-architecture megatron actor (fp32, a few hundred MB) is built on TP x PP CPU ranks (gloo) that this
command spawns itself; global rank 0 holds a CPURolloutEngine. One sync is
`mppo.rollout.weight_sync.push_actor_weights`: the exporter's TP all-gathers and PP broadcasts, un-fusing, bucketing,
and the engine's copy into its own weights. Its rate (model bytes / wall seconds, median over --repeats) is set
against memcpy bandwidth (bytes copied / second by a large tensor copy_), measured on rank 0 between the repeats
(so under the same load) with one thread and with all threads.

Where the time goes: the same sync with no engine (export only) and the time spent inside its gloo all-gather and
broadcast calls; the engine's load from tensors already in memory; the raw rates of the collectives; and the
ceiling of a shared-memory handoff (every rank copies its shards into a shared segment, rank 0 copies them out),
which is what a host-local transport could reach without gloo's TCP loopback.

The CPU path only (CUDA is hidden from the ranks): on GPUs the sync is SGLang's CUDA-IPC path, not this one.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
class CollectiveTimer:
    """Wall time spent inside torch.distributed.all_gather / broadcast calls while `active` (profiling only).

    The exporter calls them through the `torch.distributed` module, so wrapping the module attributes sees them.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds = {"all_gather": 0.0, "broadcast": 0.0}
        self.active = False
        for name in self.seconds:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    @contextmanager
    def measure(self) -> Iterator[dict[str, float]]:
        for name in self.seconds:
            self.seconds[name] = 0.0
        self.active = True
        try:
            yield self.seconds
        finally:
            self.active = False


def _timed(fn) -> float:
    """Wall seconds of a collective step, from the barrier before it to the barrier after it."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _collective_rates(nbytes: int, repeats: int) -> dict[str, float]:
    """Raw rates of the exporter's collectives on this layout's groups, for an nbytes tensor: all-gather over TP
    (bytes each rank receives / s), the same all-gather done as one broadcast per TP rank, broadcast over PP."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    shard = torch.ones(nbytes // 4)
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(shard) for _ in range(tp)]
        times = [_timed(lambda: dist.all_gather(parts, shard, group=tp_group)) for _ in range(repeats)]
        out["all_gather_Bps"] = nbytes * (tp - 1) / statistics.median(times)

        def by_broadcasts():
            for i, part in enumerate(parts):
                dist.broadcast(part, src=dist.get_global_rank(tp_group, i), group=tp_group)
        times = [_timed(by_broadcasts) for _ in range(repeats)]
        out["all_gather_by_broadcasts_Bps"] = nbytes * (tp - 1) / statistics.median(times)
    pp_group, pp = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
    if pp > 1:
        src = dist.get_global_rank(pp_group, 0)
        times = [_timed(lambda: dist.broadcast(shard, src=src, group=pp_group)) for _ in range(repeats)]
        out["broadcast_Bps"] = nbytes / statistics.median(times)
    return out


class SharedMemoryHandoff:
    """The transport ceiling for a host-local engine, without gloo: every rank copies its parameter bytes into its
    own persistent shared-memory segment, then rank 0 copies all segments into `landing` (standing in for the
    engine's resident weights). No un-fusing (a real transport would un-fuse during that last copy)."""

    def __init__(self, chunks, tag: str, landing) -> None:
        from multiprocessing import shared_memory

        import torch
        import torch.distributed as dist

        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.params = [p.detach().reshape(-1).view(torch.uint8) for c in chunks for p in c.parameters()]
        sizes: list = [None] * world
        dist.all_gather_object(sizes, sum(p.numel() for p in self.params))
        self.nbytes = sum(sizes)
        self.own = shared_memory.SharedMemory(create=True, size=sizes[self.rank], name=f"{tag}_{self.rank}")
        dist.barrier()
        self.peers = [shared_memory.SharedMemory(name=f"{tag}_{r}") for r in range(1, world)] if self.rank == 0 else []
        dist.barrier()
        self.own.unlink()  # every mapping is in place: the name can go now, so nothing leaks if a rank dies
        self.landing = landing
        self.run()  # first touch of every page, outside the timings

    def run(self) -> None:
        import torch
        import torch.distributed as dist

        own = torch.frombuffer(self.own.buf, dtype=torch.uint8)
        offset = 0
        for p in self.params:
            own[offset:offset + p.numel()].copy_(p)
            offset += p.numel()
        dist.barrier()
        del own
        if self.rank == 0:
            offset = 0
            for segment in [self.own, *self.peers]:
                src = torch.frombuffer(segment.buf, dtype=torch.uint8)
                self.landing[offset:offset + src.numel()].copy_(src)
                offset += src.numel()
                del src

    def close(self) -> None:
        for segment in (*self.peers, self.own):
            segment.close()


def rank_main(rank: int, world: int, port: int, opts: dict, out_file: str) -> None:
    """One spawned rank: build the actor, then per repeat: whole sync, export only, engine load only, shared-memory
    ceiling, memcpy (rank 0, while the others wait). Rank 0 writes the timings."""
    # CUDA_VISIBLE_DEVICES: CUDA initialises lazily, so this keeps init_distributed on gloo/CPU on a GPU machine
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    import torch

    torch.set_num_threads(opts["threads_per_rank"])
    import torch.distributed as dist

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import bucketed
    from mppo.parallel import init_distributed
    from mppo.rollout.weight_sync import push_actor_weights

    timer = CollectiveTimer()
    dims = init_distributed(opts["tp"], opts["pp"], seed=0)
    args = read_hf_config(opts["config"])
    chunks = build_gpt_model(args, dims, role="actor")
    bucket = opts["bucket_mb"] << 20
    engine, held, landing = None, {}, None
    if rank == 0:
        from transformers import Qwen2Config

        from mppo.rollout.cpu_engine import CPURolloutEngine

        engine = CPURolloutEngine(Qwen2Config(**opts["config"]))
    push_actor_weights(engine, chunks, args, bucket)  # warm-up: first touch of the engine's weights
    if rank == 0:  # the same stream already in memory (engine-only timing), and the shared-memory landing zone
        held = {name: tensor.clone() for name, tensor in engine.state_dict().items()}
        landing = torch.ones(sum(p.numel() * p.element_size() for p in engine.state_dict().values()) + (64 << 20),
                             dtype=torch.uint8)
    handoff = SharedMemoryHandoff(chunks, f"mppo_bench_{port}", landing)

    rows: dict[str, list[float]] = {k: [] for k in ("sync", "export", "all_gather", "broadcast", "load", "shm")}
    memcpy: dict[str, list[float]] = {"1": [], "all": []}
    nbytes = 0
    for _ in range(opts["repeats"]):
        stats = []
        rows["sync"].append(_timed(lambda: stats.append(push_actor_weights(engine, chunks, args, bucket))))
        nbytes = stats[0].bytes
        with timer.measure() as inside:
            rows["export"].append(_timed(lambda: push_actor_weights(None, chunks, args, bucket)))
        rows["all_gather"].append(inside["all_gather"])
        rows["broadcast"].append(inside["broadcast"])
        rows["shm"].append(_timed(handoff.run))
        if rank == 0:
            start = time.perf_counter()
            engine.update_weights(bucketed(held.items(), bucket))
            rows["load"].append(time.perf_counter() - start)
            memcpy["1"].append(memcpy_bandwidth(opts["memcpy_mb"] << 20, 1))
            memcpy["all"].append(memcpy_bandwidth(opts["memcpy_mb"] << 20, _cpu_threads()))
        dist.barrier()
    handoff.close()
    collectives = _collective_rates(64 << 20, max(2, opts["repeats"]))
    if rank == 0:
        Path(out_file).write_text(json.dumps({
            "bytes": nbytes, "shm_bytes": handoff.nbytes, "raw_seconds": rows, "raw_memcpy_Bps": memcpy,
            "seconds": {k: statistics.median(v) for k, v in rows.items() if v},
            "memcpy_Bps": {k: statistics.median(v) for k, v in memcpy.items()}, **collectives}))
    dist.barrier()
    dist.destroy_process_group()


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
             line("  export only (no engine, stream drained)", "export"),
             line("    of which inside TP all-gather (gloo)", "all_gather", None),
             line("    of which inside PP broadcast (gloo)", "broadcast", None),
             line("  engine load only (stream already in RAM)", "load"),
             line("shared-memory handoff ceiling (no un-fusing)", "shm", result["shm_bytes"])]
    for key, label in (("all_gather_Bps", "raw gloo all-gather, TP, 64 MiB (B recv/s)"),
                       ("all_gather_by_broadcasts_Bps", "raw all-gather as TP broadcasts, 64 MiB"),
                       ("broadcast_Bps", "raw gloo broadcast, PP, 64 MiB")):
        if key in result:
            lines.append(f"{label:<46} {'':>8}" + rate_cols(result[key]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    try:
        if min(opts.tp, opts.pp, opts.repeats, opts.bucket_mb, opts.threads_per_rank, opts.memcpy_mb) < 1:
            raise ValueError("--tp, --pp, --repeats, --bucket-mb, --threads-per-rank and --memcpy-mb must be >= 1")
        config = model_config(opts)
    except ValueError as err:
        print(f"mppo bench weight-sync: {err}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    all_threads = _cpu_threads()
    world = opts.tp * opts.pp
    rank_opts = dict(tp=opts.tp, pp=opts.pp, bucket_mb=opts.bucket_mb, repeats=opts.repeats,
                     threads_per_rank=opts.threads_per_rank, memcpy_mb=opts.memcpy_mb, config=config)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "rank0.json")
        mp.start_processes(rank_main, args=(world, _free_port(), rank_opts, out_file), nprocs=world,
                           start_method="spawn")
        result = json.loads(Path(out_file).read_text())
    mem1, mem_all = result["memcpy_Bps"]["1"], result["memcpy_Bps"]["all"]
    print(f"mppo bench weight-sync: Qwen2 architecture, hidden {opts.hidden}, {opts.layers} layers, ffn "
          f"{config['intermediate_size']}, heads {opts.heads}/{opts.kv_heads}, vocab {opts.vocab}, fp32, untied "
          f"head: {result['bytes'] / 2 ** 20:.1f} MiB per sync")
    print(f"layout: tp {opts.tp} x pp {opts.pp} = {world} ranks (gloo, {opts.threads_per_rank} thread(s) each), "
          f"CPURolloutEngine on rank 0, bucket {opts.bucket_mb} MiB, {opts.repeats} repeats")
    print(f"memcpy on rank 0 between repeats (copy_ of {opts.memcpy_mb} MiB; bytes copied/s): "
          f"1 thread {mem1 / GB:.2f} GB/s, {all_threads} threads {mem_all / GB:.2f} GB/s\n")
    print(render(result, all_threads))
    rate = result["bytes"] / result["seconds"]["sync"]
    print(f"\nwhole sync: {rate / GB:.2f} GB/s = {rate / mem1:.0%} of 1-thread memcpy, {rate / mem_all:.0%} of "
          f"{all_threads}-thread memcpy (goal >= 50%)")
    if opts.json:
        opts.json.write_text(json.dumps({**result, "all_threads": all_threads, "options": rank_opts}, indent=1))
    return 0
