"""The FLOP count behind perf/mfu against torch's own FlopCounterMode on HF models (the matmuls really run),
and MFU against the measured peak."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mppo.models.hf_config import read_hf_config
from mppo.trainer.model_flops import ppo_step_flops

LINEAR_OPS = ("mm", "addmm")  # linear layers; attention's score/value matmuls (bmm, sdpa) are not counted


def _linear_flops(counter: FlopCounterMode) -> int:
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if str(op).split(".")[1] in LINEAR_OPS)


def _models():
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    # SmolLM2-like (tied, GQA, big vocabulary for its size) and Qwen2 (untied, QKV bias)
    llama = LlamaConfig(vocab_size=3000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    qwen = Qwen2Config(vocab_size=1000, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    # Qwen3-MoE: HF's eager experts run each expert on the tokens routed to it only, so its matmuls are the active
    # (top-k) FLOPs; layer 1 dense (mlp_only_layers)
    moe = Qwen3MoeConfig(vocab_size=500, hidden_size=32, intermediate_size=80, moe_intermediate_size=24,
                         num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    moe._experts_implementation = "eager"  # transformers' default, grouped_mm, is not seen by FlopCounterMode
    return [LlamaForCausalLM(llama), Qwen2ForCausalLM(qwen), Qwen3MoeForCausalLM(moe)]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["llama_tied", "qwen2_untied", "qwen3_moe"])
def test_step_flops_equal_the_matmuls_of_each_pass(index, tmp_path):
    model = _models()[index]
    model.config.save_pretrained(tmp_path)
    args = read_hf_config(tmp_path)
    B, P, T = 3, 11, 5  # rows, prompt and response tokens per row
    ids = torch.randint(0, args.vocab_size, (B, P + T))

    def forward_flops(backward: bool) -> int:
        """What one pass computes: the body on every token, logits on the response tokens only."""
        with FlopCounterMode(display=False) as counter:
            hidden = model.model(ids).last_hidden_state[:, P - 1:-1]
            logits = model.lm_head(hidden)
            if backward:
                logits.float().logsumexp(-1).sum().backward()
        return _linear_flops(counter)

    forward, train = forward_flops(False), forward_flops(True)
    assert train == 3 * forward  # forward + backward of every linear layer
    counted = dict(prompt_tokens=B * P, response_tokens=B * T, use_critic=False)
    # GRPO with a reference, on-policy reuse: generation + ref + update (forward and backward)
    assert ppo_step_flops(args, **counted, use_ref=True, old_log_prob_pass=False) == 2 * forward + train
    assert ppo_step_flops(args, **counted, use_ref=False, old_log_prob_pass=True) == 2 * forward + train
    # generation is the same matmuls as a forward: prefill on the prompt, one token at a time after
    # (the output layer on the generated tokens)
    body = forward - 2 * args.vocab_size * args.hidden_size * B * T
    with FlopCounterMode(display=False) as counter:
        model.model(ids[:, :P])
    assert _linear_flops(counter) == body * P // (P + T)
    # the critic: body forward (values) + body forward and backward (its update), no output layer
    critic = ppo_step_flops(args, **{**counted, "use_critic": True}, use_ref=False, old_log_prob_pass=False)
    assert critic == forward + train + 4 * body
