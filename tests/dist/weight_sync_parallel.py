"""torchrun script (4 CPU ranks, gloo): megatron actor -> push_actor_weights -> CPU rollout engine, at several layouts.

One launch runs every case and writes out/rank{R}.json; tests/test_weight_sync.py asserts on them. References are
independent of the code under test: the HF checkpoint's safetensors files (weights), the megatron actor's own
forward through the workers' log-prob path (tests/dist/next_token.py), and the rollouts of other layouts (seeding).

In every layout the engine lives on the first rank of each DP group's model-parallel group (tp_rank 0, pp_rank 0);
that engine generates its DP slice of the global prompt list. Global rank 0 also generates the WHOLE list (DP1).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import make_hf_model  # noqa: E402
from next_token import token_logprobs  # noqa: E402

LAYOUTS = [(2, 2), (2, 1), (1, 2), (1, 1)]  # (tp, pp); DP = 4 / (tp * pp)
BUCKET_BYTES = 30_000  # several buckets for the tiny models (a layer's MLP weight alone is ~25 kB)
NUM_PROMPTS = 8
CHANGED_HF_NAME = "model.layers.3.mlp.down_proj.weight"  # row-parallel: TP rank 1 holds its second column half


def sampling_params():
    from mppo.rollout import SamplingParams

    sampled = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=8, seed=11)
    greedy = SamplingParams(do_sample=False, max_new_tokens=8)
    return {"sampled": (sampled, 0.7), "greedy": (greedy, 1.0)}  # greedy log-probs are at temperature 1


def make_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, 10, (NUM_PROMPTS,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def as_rows(responses) -> list[list]:
    return [[r.prompt_index, r.sample_index, r.token_ids, r.log_probs, r.finish_reason] for r in responses]


def bitwise_report(engine, hf_dir: Path) -> str:
    """'ok' when every checkpoint tensor (and lm_head, tied or not) equals the engine's weight bit for bit."""
    from safetensors.torch import load_file

    original = load_file(str(hf_dir / "model.safetensors"))
    state = engine.state_dict()
    lm_head = original.get("lm_head.weight", original["model.embed_tokens.weight"])  # tied: lm_head IS embed
    expected = {**original, "lm_head.weight": lm_head}
    if set(state) != set(expected):
        return f"names differ: {sorted(set(state) ^ set(expected))}"
    bad = [k for k, t in expected.items()
           if state[k].dtype != t.dtype or not torch.equal(state[k].view(torch.int32), t.view(torch.int32))]
    return f"tensors differ: {bad}" if bad else "ok"


def actor_logprob_diff(chunks, args, rows: list[list], prompts: list[list[int]], temperature: float) -> float:
    """max |engine rollout log-prob - actor log-prob| over every response token of `rows` (right-padded rows,
    column t of the log-probs is token t+1)."""
    seqs = [(prompts[p], tokens, lps) for p, _, tokens, lps, _ in rows]
    micro = []
    for i in range(0, len(seqs), 4):
        part = seqs[i:i + 4]
        width = max(len(p) + len(t) for p, t, _ in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        for j, (p, t, _) in enumerate(part):
            ids[j, :len(p) + len(t)] = torch.tensor(p + t)
        micro.append({"input_ids": ids})
    outs = token_logprobs(chunks, micro, vocab_size=args.vocab_size, temperature=temperature, micro_batch_size=4)
    worst = 0.0
    for i, out in enumerate(outs):
        for j, (p, t, lps) in enumerate(seqs[i * 4:(i + 1) * 4]):
            actor = out["log_probs"][j, len(p) - 1:len(p) - 1 + len(t)]
            worst = max(worst, (actor - torch.tensor(lps, dtype=torch.float32)).abs().max().item())
    return worst


def engine_rows_by_dp(local_rows, dp_rank: int) -> list[list]:
    """This DP group's engine rollouts on every rank of the group (collective over the world)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, local_rows))
    return [row for d, rows in gathered if d == dp_rank and rows is not None for row in rows]


def run_layout(work: Path, res: dict, tp: int, pp: int) -> None:
    from transformers import AutoConfig

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import load_hf_weights
    from mppo.parallel import destroy, init_distributed
    from mppo.models.weight_transport import is_staged
    from mppo.models.weights import iter_hf_weights
    from mppo.rollout.cpu_engine import CPURolloutEngine
    from mppo.rollout.weight_sync import push_actor_weights

    dims = init_distributed(tp, pp, seed=1234)
    layout = f"tp{tp}pp{pp}"
    holds_engine = dims.tp_rank == 0 and dims.pp_rank == 0
    names = ("qwen2_untied", "qwen2_tied") if (tp, pp) == (2, 2) else ("qwen2_untied",)
    for name in names:
        key = f"{layout}/{name}"
        args = read_hf_config(work / name)
        chunks = build_gpt_model(args, dims, role="actor")
        load_hf_weights(chunks, work / name, args)
        engine = CPURolloutEngine(AutoConfig.from_pretrained(work / name)) if holds_engine else None
        stats = push_actor_weights(engine, chunks, args, BUCKET_BYTES)
        res[f"{key}/sync"] = [stats.bytes, stats.buckets]
        if engine is not None:
            res[f"{key}/bitwise"] = bitwise_report(engine, work / name)
            res[f"{key}/adopted"] = all(is_staged(t) for t in engine.state_dict().values())
        if name == "qwen2_untied" and (tp, pp) == (2, 2):
            # another model of the same shapes (random values), staged to the engine's rank: it has buffers of its
            # own, so the engine's kept weights must not change
            other = build_gpt_model(args, dims, role="actor")
            for _ in iter_hf_weights(other, args, destinations=[0]):
                pass
            if engine is not None:
                res[f"{key}/bitwise_after_other_model"] = bitwise_report(engine, work / name)
            del other
        if name == "qwen2_untied" and (tp, pp) != (1, 1):
            transport_cases(work / name, res, key, chunks, args, bf16=(tp, pp) == (2, 2))

        prompts = make_prompts(args.vocab_size)
        share = NUM_PROMPTS // dims.dp
        mine = list(range(dims.dp_rank * share, (dims.dp_rank + 1) * share))
        for kind, (sampling, temperature) in sampling_params().items():
            local = None
            if engine is not None:
                local = as_rows(engine.generate([prompts[i] for i in mine], sampling, step=3, prompt_offsets=mine))
                res[f"{key}/{kind}/dp_rollouts"] = local
                if dims.rank == 0:
                    res[f"{key}/{kind}/full_rollouts"] = as_rows(engine.generate(prompts, sampling, step=3))
            rows = engine_rows_by_dp(local, dims.dp_rank)
            res[f"{key}/{kind}/actor_diff"] = actor_logprob_diff(chunks, args, rows, prompts, temperature)
            if kind == "sampled" and (tp, pp) == (2, 2):  # the check is sensitive to the temperature semantics
                res[f"{key}/{kind}/actor_diff_at_t1"] = actor_logprob_diff(chunks, args, rows, prompts, 1.0)

        if (tp, pp) == (2, 2) and name == "qwen2_untied":
            staging_lifecycle(work / name, res, key, chunks, args, opts_out=work.parent)
            change_and_resync(work, res, key, dims, chunks, args, engine, prompts)
    destroy()


def change_and_resync(work, res, key, dims, chunks, args, engine, prompts) -> None:
    """Perturb one TP shard on the last stage, release the engine, sync again: the engine must follow the actor."""
    from safetensors.torch import load_file

    from mppo.rollout.weight_sync import push_actor_weights

    greedy, _ = sampling_params()["greedy"]
    before = as_rows(engine.generate(prompts, greedy, step=0)) if engine is not None else None
    if dims.tp_rank == 1 and dims.is_last_stage:
        weight = chunks[0].decoder.layers[-1].mlp.linear_fc2.weight
        with torch.no_grad():
            weight.add_(0.2 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)))
    if engine is not None:
        engine.release()  # the trainer's cycle: release for training, update_weights re-allocates, then resume
    push_actor_weights(engine, chunks, args, BUCKET_BYTES)
    after = None
    if engine is not None:
        engine.resume()
        after = as_rows(engine.generate(prompts, greedy, step=0))
        first_token = [abs(a[3][0] - b[3][0]) for a, b in zip(after, before)]
        res[f"{key}/changed/first_logprob_shift"] = max(first_token)
        new = engine.state_dict()[CHANGED_HF_NAME]
        old = load_file(str(work / "qwen2_untied" / "model.safetensors"))[CHANGED_HF_NAME]
        half = old.shape[1] // 2
        res[f"{key}/changed/left_half_same"] = bool(torch.equal(new[:, :half], old[:, :half]))
        res[f"{key}/changed/right_half_changed"] = bool((new[:, half:] != old[:, half:]).float().mean() > 0.99)
    rows = engine_rows_by_dp(after, dims.dp_rank)
    res[f"{key}/changed/actor_diff"] = actor_logprob_diff(chunks, args, rows, prompts, 1.0)


def stream_report(items, expected: dict[str, torch.Tensor], order: list[str] | None) -> str:
    """'ok/staged' or 'ok/fresh' when `items` are exactly the expected tensors (bit for bit, dtype included) in
    HF order; 'empty' for no items; else what is wrong."""
    from mppo.models.weight_transport import is_staged

    if not items:
        return "empty"
    names = [n for n, _ in items]
    if set(names) != set(expected) or len(names) != len(expected):
        return f"names differ: {sorted(set(names) ^ set(expected))} ({len(names)} items)"
    if order is not None and names != order:
        return "order differs from the HF order"
    bad = [n for n, t in items if t.dtype != expected[n].dtype or t.shape != expected[n].shape
           or not torch.equal(t.contiguous().view(torch.uint8), expected[n].contiguous().view(torch.uint8))]
    if bad:
        return f"tensors differ: {bad}"
    staged = [is_staged(t) for _, t in items]
    return "ok/staged" if all(staged) else "ok/fresh" if not any(staged) else "ok/mixed"


def hf_order(hf_dir: Path) -> list[str]:
    """HF order as the exporter promises it: embedding, layers in order, final norm, head; per layer the rules'
    order (q, k, v (weight then bias), o, ...)."""
    from safetensors.torch import load_file

    def rank(name):
        if name.startswith("model.embed_tokens"):
            return (0, 0, 0)
        if name.startswith("model.norm"):
            return (2, 0, 0)
        if name.startswith("lm_head"):
            return (3, 0, 0)
        layer, rest = name.split(".")[2], name.split(".", 3)[3]
        sequence = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                    "self_attn.v_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                    "self_attn.v_proj.bias", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        return (1, int(layer), sequence.index(rest))

    return sorted(load_file(str(hf_dir / "model.safetensors")), key=rank)


def transport_cases(hf_dir: Path, res: dict, key: str, chunks, args, bf16: bool) -> None:
    """Every transport and destination choice against the HF checkpoint (bitwise), on every rank of the group."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from mppo.models.weights import iter_hf_weights

    expected = load_file(str(hf_dir / "model.safetensors"))
    order = hf_order(hf_dir)
    group = dist.get_process_group_ranks(ps.get_model_parallel_group())
    leader, last = group[0], group[-1]  # `last` is neither TP rank 0 nor on the first stage (tp, pp > 1)
    cases = {
        "collective_all": dict(destinations=None, transport="collective"),
        "auto_all": dict(destinations=None),  # every rank a destination: stays collective
        "collective_last": dict(destinations=[last], transport="collective"),
        "collective_two": dict(destinations=[leader, last], transport="collective"),
        "auto_last": dict(destinations=[last]),  # gloo on one host: staged
        "shm_leader": dict(destinations=[leader], transport="shared_memory"),
        "shm_two": dict(destinations=[leader, last], transport="shared_memory"),
        "shm_all": dict(destinations=None, transport="shared_memory"),
    }
    if bf16:
        cases["shm_bf16"] = dict(destinations=[last], transport="shared_memory", dtype=torch.bfloat16)
        cases["collective_bf16"] = dict(destinations=[last], transport="collective", dtype=torch.bfloat16)
    for case, kwargs in cases.items():
        want = {n: t.to(kwargs.get("dtype", torch.float32)) for n, t in expected.items()}
        res[f"{key}/transport/{case}"] = stream_report(list(iter_hf_weights(chunks, args, **kwargs)), want, order)
    res[f"{key}/transport/group"] = group


def consume_then_fail(stream, after: int) -> int:
    """Read `after` items (on ranks that get any), then fail like a consumer would; returns how many were read.
    A function of its own, so that no local keeps a staged view alive afterwards."""
    consumed = 0
    try:
        for _ in stream:
            consumed += 1
            if consumed == after:
                raise RuntimeError("consumer failed mid-stream")
    except RuntimeError:
        pass
    return consumed


def staging_lifecycle(hf_dir: Path, res: dict, key: str, chunks, args, opts_out: Path) -> None:
    """Staging buffers in a private directory: no file survives the setup, an exception mid-stream, or a failed
    setup (reported on every rank); released buffers leave no mapping; exports after each failure are right."""
    import errno
    import gc
    import hashlib
    import shutil

    from safetensors.torch import load_file

    from mppo.models import weight_transport
    from mppo.models.weights import iter_hf_weights

    expected = load_file(str(hf_dir / "model.safetensors"))
    shm_dir = Path("/dev/shm") / f"mppo-test-{hashlib.sha1(str(opts_out.resolve()).encode()).hexdigest()[:12]}"
    if dist.get_rank() == 0:
        shm_dir.mkdir()
    dist.barrier()
    real_dir, weight_transport.SHM_DIR = weight_transport.SHM_DIR, shm_dir
    weight_transport.release_staging_buffers()  # the next export sets up again, in shm_dir
    try:
        export = lambda: iter_hf_weights(chunks, args, destinations=[0])  # noqa: E731
        first = list(export())
        res[f"{key}/life/first"] = stream_report(first, expected, None)
        res[f"{key}/life/files_after_export"] = sorted(os.listdir(shm_dir))
        maps = Path("/proc/self/maps").read_text()
        res[f"{key}/life/mapped"] = bool(weight_transport.held_segments()) and all(
            seg in maps for seg in weight_transport.held_segments())
        del first

        res[f"{key}/life/consumed_before_error"] = consume_then_fail(export(), after=3)
        res[f"{key}/life/files_after_error"] = sorted(os.listdir(shm_dir))
        res[f"{key}/life/after_error"] = stream_report(list(export()), expected, None)

        segments = weight_transport.held_segments()
        weight_transport.release_staging_buffers()
        gc.collect()
        maps = Path("/proc/self/maps").read_text()
        res[f"{key}/life/unmapped_after_release"] = bool(segments) and not any(seg in maps for seg in segments)

        real_fallocate = os.posix_fallocate
        if dist.get_rank() == 0:  # the destination creates the segment: make its /dev/shm look full
            def full(fd, offset, length):
                raise OSError(errno.ENOSPC, "No space left on device")
            os.posix_fallocate = full
        try:
            list(export())
            res[f"{key}/life/setup_error"] = "no error"
        except weight_transport.StagingError as err:
            res[f"{key}/life/setup_error"] = str(err)
        finally:
            os.posix_fallocate = real_fallocate
        dist.barrier()  # the destination unlinks while its error propagates: look once every rank is past it
        res[f"{key}/life/files_after_setup_error"] = sorted(os.listdir(shm_dir))
        res[f"{key}/life/after_setup_error"] = stream_report(list(export()), expected, None)
    finally:
        weight_transport.release_staging_buffers()
        weight_transport.SHM_DIR = real_dir
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(shm_dir, ignore_errors=True)


def run_layouts(opts, res: dict) -> None:
    work = opts.out / "work"
    if dist.get_rank() == 0:
        make_hf_model("qwen2_untied", work / "qwen2_untied", seed=0)
        make_hf_model("qwen2_tied", work / "qwen2_tied", seed=1)
    dist.barrier()
    for tp, pp in LAYOUTS:
        run_layout(work, res, tp, pp)


def main() -> None:
    torch.set_num_threads(1)  # the CPU engine is batch-invariant (DP splits bitwise equal) single-threaded
    rank_main(run_layouts)


if __name__ == "__main__":
    main()
