"""LoRA's initial adapters and dropout, on 2 CPU ranks (tests/test_lora_init.py asserts on the results).

seed: ActorWorkers built at TP2 and at TP1 (DP2) with megatron.seed 0 and 5 (the seed the trainer resolves from
trainer.seed): the gathered initial A per seed, compared across layouts and seeds.
dropout (lora.dropout = 0.3, adapters with B != 0): at TP1 the log-prob pass (eval mode) gives the logits of
dropout 0 bitwise, and a training-mode forward equals HF + PEFT (lora_dropout 0.3) in training mode from the same
generator state: the same masks, drawn per adapter in the same order; at TP2 the masks of a TP-split input
(row-parallel linear_proj) differ between the TP ranks, those of a replicated one (linear_qkv) are equal.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import make_hf_model  # noqa: E402

MODEL = "qwen2_untied"
SEEDS = (0, 5)


def _actor_config(tp: int, seed: int):
    from mppo.config.schema import ActorConfig, MegatronConfig

    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, kernel_backend="torch")
    cfg.megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, seed=seed)
    return cfg


def seed_cases(work: Path, res: dict) -> None:
    from mppo.config.schema import LoRAConfig, ModelConfig
    from mppo.models.lora_io import gather_peft_tensors
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker

    initial: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for tp in (2, 1):
        for seed in SEEDS:
            dims = init_distributed(tp, 1, seed=1234)
            actor = ActorWorker(ModelConfig(lora=LoRAConfig(rank=4, alpha=8.0, target_modules=["all-linear"])),
                                _actor_config(tp, seed), dims, work / MODEL, total_steps=1)
            initial[tp, seed] = gather_peft_tensors(actor.model)
            del actor
            destroy()
    a_keys = sorted(k for k in initial[1, 0] if ".lora_A." in k)
    res["seed/a_keys"] = len(a_keys)
    res["seed/same_keys"] = all(sorted(t) == sorted(initial[1, 0]) for t in initial.values())
    for seed in SEEDS:  # TP2 (A split over TP for o/down, replicated for the rest) vs TP1: the same full tensors
        res[f"seed/{seed}/tp2_equals_tp1"] = all(torch.equal(initial[2, seed][k], initial[1, seed][k]) for k in a_keys)
    res["seed/other_seed_differs"] = all(not torch.equal(initial[1, 0][k], initial[1, 5][k]) for k in a_keys)
    res["seed/b_zero"] = all(not t.any() for v in initial.values() for k, t in v.items() if ".lora_B." in k)


DROPOUT, RANK, ALPHA = 0.3, 4, 8.0


def _dropout_model(work: Path, args, dims, tensors, dropout: float):
    from mppo.config.lora import HF_PROJECTIONS
    from mppo.models.builders import build_gpt_model
    from mppo.models.lora import LoRASpec, apply_lora
    from mppo.models.lora_io import load_peft_tensors
    from mppo.models.weights import load_hf_weights

    chunks = build_gpt_model(args, dims, role="actor")
    load_hf_weights(chunks, work / MODEL, args)
    apply_lora(chunks, args, LoRASpec(rank=RANK, alpha=ALPHA, dropout=dropout, projections=HF_PROJECTIONS))
    load_peft_tensors(chunks, tensors)
    return chunks


def dropout_cases(work: Path, res: dict) -> None:
    from megatron.core import parallel_state as ps
    from peft import PeftModel

    from lora_cases import write_reference_adapter
    from models_fixtures import load_hf_model
    from models_parallel import micro_batches
    from next_token import token_logits
    from peft_reference import random_adapter_tensors
    from mppo.config.lora import HF_PROJECTIONS
    from mppo.models.hf_config import read_hf_config
    from mppo.models.lora import iter_adapters, projection_shapes
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.pipeline import stage_forward

    args = read_hf_config(work / MODEL)
    tensors = random_adapter_tensors(projection_shapes(args), args.num_layers, HF_PROJECTIONS, RANK, seed=11)
    dims = init_distributed(1, 1, seed=1234)
    dropped, plain = (_dropout_model(work, args, dims, tensors, p) for p in (DROPOUT, 0.0))
    batches = micro_batches(args.vocab_size, seed=3)
    for chunk in dropped:
        chunk.train()  # as after an update: the log-prob pass must switch dropout off itself
    res["dropout/eval_bitwise_dropout0"] = all(
        torch.equal(a["logits"], b["logits"]) for a, b in zip(token_logits(dropped, batches, args.vocab_size),
                                                                token_logits(plain, batches, args.vocab_size)))
    ids = batches[0]["input_ids"][:1]  # one row: [s, 1, h] and HF's [1, s, h] draw their masks in the same order
    adapter_dir = work / f"peft_dropout_rank{dist.get_rank()}"
    write_reference_adapter(adapter_dir, tensors)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "lora_dropout": DROPOUT,
                                                                  "r": RANK, "lora_alpha": ALPHA}))
    peft = PeftModel.from_pretrained(load_hf_model(work / MODEL), str(adapter_dir), is_trainable=True)
    peft.train()
    for chunk in dropped:
        chunk.train()
    outs = {}
    for name, run in (("mppo", lambda: stage_forward(dropped[0], ids, hidden_only=False)),
                      ("peft", lambda: peft(ids).logits)):
        torch.manual_seed(77)
        with torch.no_grad():
            outs[name] = run()[..., :args.vocab_size].float()
    with torch.no_grad():
        dropped[0].eval()
        eval_out = stage_forward(dropped[0], ids, hidden_only=False)[..., :args.vocab_size].float()
    res["dropout/train_vs_peft_same_masks"] = (outs["mppo"] - outs["peft"]).abs().max().item()
    res["dropout/train_vs_eval"] = (outs["mppo"] - eval_out).abs().max().item()  # the masks matter
    del dropped, plain, peft
    destroy()

    dims = init_distributed(2, 1, seed=1234)
    chunks = _dropout_model(work, args, dims, tensors, DROPOUT)
    chunks[0].train()
    masks = {}
    for adapters in iter_adapters(chunks):
        if adapters.hf_prefix.startswith("model.layers.0.") and adapters.linear_name in ("linear_qkv", "linear_proj"):
            width = adapters.lora_A[adapters.projections[0]].shape[1]
            masks[adapters.linear_name] = torch.stack(
                [d != 0 for d in adapters.dropped_inputs(torch.ones(16, 1, width))]).float()
    group = ps.get_tensor_model_parallel_group()
    for name, mask in masks.items():
        parts = [torch.empty_like(mask) for _ in range(2)]
        dist.all_gather(parts, mask, group=group)
        res[f"dropout/tp2/{name}/same_on_tp_ranks"] = torch.equal(parts[0], parts[1])
        res[f"dropout/tp2/{name}/keep_fraction"] = mask.mean().item()
    qkv = masks["linear_qkv"]
    res["dropout/tp2/qkv_masks_per_projection_differ"] = not torch.equal(qkv[0], qkv[1])
    destroy()


def main(opts, res: dict) -> None:
    work = opts.out / "work"
    if dist.get_rank() == 0:
        make_hf_model(MODEL, work / MODEL, seed=0)
    dist.barrier()
    seed_cases(work, res)
    dropout_cases(work, res)


if __name__ == "__main__":
    rank_main(main)
