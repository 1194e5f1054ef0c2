"""torchrun script (4 CPU ranks, gloo): megatron actor -> push_actor_weights -> CPU rollout engine, at several layouts.

One launch runs every case and writes out/rank{R}.json; tests/test_weight_sync.py asserts on them. References are
independent of the code under test: the HF checkpoint's safetensors files (weights), the megatron actor's own
forward through compute_token_logprobs (log-probs), and the rollouts of other layouts (seeding).

In every layout the engine lives on the first rank of each DP group's model-parallel group (tp_rank 0, pp_rank 0);
that engine generates its DP slice of the global prompt list. Global rank 0 also generates the WHOLE list (DP1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models_fixtures import make_hf_model  # noqa: E402

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
    column t of compute_token_logprobs is token t+1)."""
    from mppo.workers.pipeline import compute_token_logprobs

    seqs = [(prompts[p], tokens, lps) for p, _, tokens, lps, _ in rows]
    micro = []
    for i in range(0, len(seqs), 4):
        part = seqs[i:i + 4]
        width = max(len(p) + len(t) for p, t, _ in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        for j, (p, t, _) in enumerate(part):
            ids[j, :len(p) + len(t)] = torch.tensor(p + t)
        micro.append({"input_ids": ids})
    outs = compute_token_logprobs(chunks, micro, vocab_size=args.vocab_size, temperature=temperature)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    work = opts.out / "work"
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)  # the CPU engine is batch-invariant (DP splits bitwise equal) single-threaded
    res: dict = {}
    from mppo.parallel import destroy, init_distributed

    init_distributed(1, 1)  # the process group; layouts are rebuilt per case
    destroy()
    try:
        if rank == 0:
            make_hf_model("qwen2_untied", work / "qwen2_untied", seed=0)
            make_hf_model("qwen2_tied", work / "qwen2_tied", seed=1)
        dist.barrier()
        for tp, pp in LAYOUTS:
            run_layout(work, res, tp, pp)
    except Exception:
        res["crash"] = traceback.format_exc()
        raise
    finally:
        (opts.out / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
