"""A tiny, complete PPO run directory for end-to-end tests: countdown data, a local tokenizer, a random Qwen2 (or
Qwen3-MoE)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

# A random model never solves countdown, so every score, advantage and loss of a step would be 0 and comparisons
# of them would prove nothing. This reward (a user reward function, as `reward.custom_fn` loads one) gives every
# response a different non-zero score.
DENSE_REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    text = solution_str or ""
    return (sum(ch.isdigit() for ch in text) + 0.25 * len(set(text))) / (1.0 + len(text))
'''


def dense_reward(root: Path) -> list[str]:
    """Overrides that score with DENSE_REWARD_FN (written by make_assets)."""
    return [f"reward.custom_fn.path={root}/dense_reward.py"]


def make_assets(root: Path, *, train_size: int = 64, test_size: int = 16, hidden: int = 32,
                layers: int = 2, arch: str = "qwen2") -> Path:
    """Write root/data/{train,test}.parquet and root/model (a random HF Qwen2, Llama with arch="llama" or a
    Qwen3-MoE of 4 experts, top-2, with arch="qwen3_moe", and a tokenizer); return root."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    from mppo.data import build_local_tokenizer, write_task

    write_task("countdown", root / "data", train_size=train_size, test_size=test_size, seed=0, num_operands=3,
               max_number=20, max_target=50)
    rows = pq.read_table(root / "data" / "train.parquet").to_pylist()
    texts = [r["prompt"][0]["content"] for r in rows] + [str(r["extra_info"]["solution"]) for r in rows]
    tokenizer = build_local_tokenizer(texts, 320, root / "model")
    torch.manual_seed(0)
    fields = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=None)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**fields, moe_intermediate_size=hidden, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True, head_dim=hidden // 4)
        Qwen3MoeForCausalLM(config).save_pretrained(root / "model", safe_serialization=True)
    else:
        config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
        model_cls(config_cls(**fields)).save_pretrained(root / "model", safe_serialization=True)
    (root / "dense_reward.py").write_text(DENSE_REWARD_FN)
    return root


# Overrides that make configs/demo_cpu.yaml a seconds-long run on `root`.
def tiny_overrides(root: Path, run_dir: Path, *, world: int, tp: int = 1, pp: int = 1, steps: int = 2,
                   estimator: str = "gae", n: int = 1) -> list[str]:
    return [
        f"data.train_files={root}/data/train.parquet", f"data.val_files={root}/data/test.parquet",
        "data.train_batch_size=8", "data.val_batch_size=16", "data.max_prompt_length=400",
        "data.max_response_length=12", f"actor_rollout_ref.model.path={root}/model",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.rollout.n={n}", f"algorithm.adv_estimator={estimator}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"trainer.n_gpus_per_node={world}", f"trainer.total_training_steps={steps}", "trainer.test_freq=1",
        "trainer.save_freq=1", "trainer.val_before_train=true", f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console]",
        # veRL's default decay: test_reliability_numerics sees step 2's update (all-zero rewards) through it
        "actor_rollout_ref.actor.optim.weight_decay=0.01",
    ]


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: every metric logged for that step} (validation and training rows merged)."""
    merged: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            merged.setdefault(row["step"], {}).update(row)
    return merged
