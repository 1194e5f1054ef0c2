"""Benchmark inputs made locally: TinyZero countdown data, a local tokenizer and a random Qwen2 model (HF dir).

Every benchmark (`mppo bench step`, `scaling`, `trl-compare`) trains on the same kind of run directory, so their
figures are comparable: `make_bench_assets(root)` writes

    root/data/{train,test}.parquet   countdown prompts (veRL/TinyZero rows)
    root/model/                      Qwen2ForCausalLM (random, fp32 safetensors) + the local tokenizer

and `bench_overrides(root, ...)` turns configs/demo_cpu.yaml into a run on it. The model is random: benchmarks
measure speed, and the TRL side-by-side compares rewards of a learnable toy reward (see mppo.bench._trl_grpo).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ASSETS_STAMP = "bench_assets.json"


@dataclass(frozen=True)
class ModelSize:
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 512  # tokenizer target; the trained BPE may end up smaller
    max_positions: int = 2048
    eos_probability: float = 0.0  # > 0: make every step stop with about this probability (see `raise_eos`)
    experts: int = 0  # > 0: a Qwen3-MoE with this many experts (top-2, experts of half the dense MLP width)


def make_bench_assets(root: str | Path, *, size: ModelSize = ModelSize(), train_size: int = 512,
                      test_size: int = 32, seed: int = 0) -> Path:
    """Write root/data and root/model (skipped when root already holds assets of the same size and seed)."""
    import pyarrow.parquet as pq

    from mppo.data import build_local_tokenizer, write_task
    from mppo.sft import TinyModelSpec, init_tiny_model

    root = Path(root)
    stamp = {"size": asdict(size), "train_size": train_size, "test_size": test_size, "seed": seed}
    stamp_path = root / ASSETS_STAMP
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return root
    write_task("countdown", root / "data", train_size=train_size, test_size=test_size, seed=seed, num_operands=3,
               max_number=20, max_target=50)
    rows = pq.read_table(root / "data" / "train.parquet").to_pylist()
    texts = [r["prompt"][0]["content"] for r in rows] + [str(r["extra_info"]["solution"]) for r in rows]
    tokenizer = build_local_tokenizer(texts, size.vocab, root / "model")
    spec = TinyModelSpec(hidden_size=size.hidden, num_layers=size.layers, num_heads=size.heads,
                         num_kv_heads=size.kv_heads, intermediate_size=int(2.75 * size.hidden),
                         max_position_embeddings=size.max_positions, tie_word_embeddings=False)
    model = init_tiny_model(tokenizer, spec, seed=seed) if not size.experts else _tiny_moe(tokenizer, spec, size, seed)
    if size.eos_probability > 0:
        raise_eos(model, tokenizer.eos_token_id, size.eos_probability)
    model.save_pretrained(root / "model", safe_serialization=True)
    stamp_path.write_text(json.dumps(stamp))
    return root


def _tiny_moe(tokenizer, spec, size: ModelSize, seed: int):
    """A random fp32 Qwen3MoeForCausalLM of the same shape as the dense bench model, every layer MoE."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size // 2, num_experts=size.experts, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config).float()


def raise_eos(model, eos_token_id: int, probability: float) -> None:
    """Give a random Qwen2 a near-constant EOS probability per generated token, so response lengths spread
    widely (about geometric, mean 1/probability, cut at the maximum length), like a real policy's do.

    A random model's logits are nearly uniform, so it stops with probability ~1/vocab and almost every response
    runs to the maximum length: no length spread, which would hide padding costs. Here one hidden channel carries
    a constant: every token embeds it and no layer writes to it (its rows of o_proj and down_proj are zero), so
    after the final RMSNorm it is nearly the same for every token, and only the EOS row of the LM head reads it:
    a constant added to the EOS logit. Its size is calibrated on random token sequences: a few steps that move
    the EOS weight by the logit gap between the wanted and the measured mean EOS probability.
    """
    import math

    import torch

    if not 0 < probability < 1:
        raise ValueError(f"eos probability must be in (0, 1), got {probability}")
    channel = model.config.hidden_size - 1
    vocab = model.config.vocab_size
    probe = torch.randint(0, vocab, (4, 256), generator=torch.Generator().manual_seed(0))

    def logit(p: float) -> float:
        return math.log(p / (1 - p))

    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[channel, :] = 0.0
            if hasattr(layer.mlp, "experts"):  # Qwen3-MoE: [experts, hidden, intermediate]
                layer.mlp.experts.down_proj[:, channel, :] = 0.0
            else:
                layer.mlp.down_proj.weight[channel, :] = 0.0
        head = model.lm_head.weight
        head[:, channel] = 0.0
        normed = model.model(probe).last_hidden_state[..., channel].mean().item()
        bias = logit(probability) + math.log(vocab - 1)  # p = e^b / (e^b + vocab - 1) if other logits were 0
        for _ in range(4):
            head[eos_token_id, channel] = bias / normed
            measured = model(probe).logits.softmax(-1)[..., eos_token_id].mean().item()
            bias += logit(probability) - logit(measured)
        head[eos_token_id, channel] = bias / normed


def bench_overrides(root: str | Path, run_dir: str | Path, *, world: int = 1, batch: int = 16,
                    response_length: int = 64, estimator: str = "gae", n: int = 1) -> list[str]:
    """Overrides of configs/demo_cpu.yaml for a benchmark run on `root` (no validation, no checkpoints).

    gae: PPO with critic and KL in the reward (TinyZero's recipe); grpo: group size n, KL as a loss, no critic.
    """
    common = [
        f"data.train_files={root}/data/train.parquet", "data.val_files=null",
        f"data.train_batch_size={batch}", "data.max_prompt_length=512",
        f"data.max_response_length={response_length}", f"actor_rollout_ref.model.path={root}/model",
        f"actor_rollout_ref.rollout.n={n}", f"algorithm.adv_estimator={estimator}",
        f"trainer.n_gpus_per_node={world}", "trainer.total_training_steps=1000", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.val_before_train=false", f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console]", "trainer.resume_mode=disable",
        # benchmarks measure the product's default layer spec (SDPA without Transformer Engine), not the demo's
        # pinned local spec, whose unfused attention costs 1.5x the update's CPU time even at 200 tokens
        "actor_rollout_ref.model.transformer_impl=auto",
    ]
    if estimator == "gae":
        return common + ["critic.enable=true", "algorithm.use_kl_in_reward=true",
                         "actor_rollout_ref.actor.use_kl_loss=false"]
    return common + ["critic.enable=false", "algorithm.use_kl_in_reward=false",
                     "actor_rollout_ref.actor.use_kl_loss=true"]


def main(argv: list[str] | None = None) -> int:
    """`mppo bench assets --out DIR`: write the benchmarks' inputs (data + model) to DIR, e.g. to train on them."""
    import argparse

    p = argparse.ArgumentParser(prog="mppo bench assets", description=main.__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden", type=int, default=ModelSize.hidden)
    p.add_argument("--layers", type=int, default=ModelSize.layers)
    p.add_argument("--eos-prob", type=float, default=0.0, help="per-token stop probability (0: the random model's)")
    opts = p.parse_args(argv)
    make_bench_assets(opts.out, size=ModelSize(hidden=opts.hidden, layers=opts.layers, eos_probability=opts.eos_prob))
    print(f"bench assets in {opts.out}: data/train.parquet, data/test.parquet, model/")
    return 0
