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
                layers: int = 2, arch: str = "qwen2", tool_tokens: bool = False) -> Path:
    """Write root/data/{train,test}.parquet and root/model (a random HF Qwen2, Llama with arch="llama" or a
    Qwen3-MoE of 4 experts, top-2, with arch="qwen3_moe", and a tokenizer, with TOOL_TOKENS added when
    `tool_tokens`: make_tool_policy needs them); return root."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    from mppo.data import build_local_tokenizer, write_task

    write_task("countdown", root / "data", train_size=train_size, test_size=test_size, seed=0, num_operands=3,
               max_number=20, max_target=50)
    rows = pq.read_table(root / "data" / "train.parquet").to_pylist()
    texts = [r["prompt"][0]["content"] for r in rows] + [str(r["extra_info"]["solution"]) for r in rows]
    tokenizer = build_local_tokenizer(texts, 320, root / "model")
    if tool_tokens:
        tokenizer.add_tokens(list(TOOL_TOKENS))
        tokenizer.save_pretrained(root / "model")
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


# The tokens of make_tool_policy's calls: the call's start, two bodies (the calculator on 3 * 4 or 3 + 4) and its
# end, each one token, so that a model reading only the last token can write a whole call.
TOOL_TOKENS = ("<tool_call>", '{"name": "calculator", "arguments": {"expression": "3 * 4"}}',
               '{"name": "calculator", "arguments": {"expression": "3 + 4"}}', "</tool_call>")


def make_tool_policy(root: Path, *, margin: float = 24.0, noise: float = 25.0) -> Path:
    """root/tool_model: root/model (make_assets(..., tool_tokens=True)) with weights that call the calculator once.

    A random model never writes a tool call, so multi-turn rollouts on a real engine would have no tool turns. Here
    four hidden dimensions are given over to a chain the last token decides, each link by a logit `margin` over
    every other token: the prompts' last token (`<think>`'s `>`) leads to `<tool_call>`, that to either call body
    (the calculator on 3 * 4 or 3 + 4, about half and half), that to `</tool_call>`. After the tool turn the model
    is the random one (its head's random part scaled by `noise`, so its text log-probs vary with the whole
    context), except that the fourth dimension keeps the chain's tokens out of that text: every response is one
    call, its tool turn, then free text. The config is root/model's: an engine serving root/model can serve it
    (weights are pushed)."""
    import shutil

    import safetensors.torch

    from mppo.data import load_tokenizer

    src, out = root / "model", root / "tool_model"
    shutil.copytree(src, out, dirs_exist_ok=True)
    tok = load_tokenizer(src)
    rows = pq.read_table(root / "data" / "train.parquet").to_pylist()
    (trigger,) = {tok.encode(r["prompt"][0]["content"])[-1] for r in rows}  # the prompts' common last token
    start, body_a, body_b, end = (tok.convert_tokens_to_ids(t) for t in TOOL_TOKENS)
    chain = [trigger, start, body_a, body_b, end]
    weights = safetensors.torch.load_file(str(src / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    link = margin / embed.shape[1] ** 0.5  # the final norm makes a chain token's coordinate about sqrt(hidden)
    embed[:, :4] = 0.0
    head[:, :4] = 0.0
    head[:, 4:] *= noise
    embed[trigger, 0] = embed[start, 1] = embed[body_a, 2] = embed[body_b, 2] = 1.0
    head[start, 0] = head[body_a, 1] = head[body_b, 1] = head[end, 2] = link
    # after any other token the chain's tokens are 3 margins down: no second call, no stray </tool_call>
    embed[[t for t in range(embed.shape[0]) if t not in chain], 3] = 0.1
    head[chain, 3] = -3.0 * link
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[:4] = 0.0  # the layers never write the chain's dimensions
    safetensors.torch.save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


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
