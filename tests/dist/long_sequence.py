"""A lone process (world of one, gloo): the actor's log-prob pass and PPO update on one prompt + response of
`--prompt` + `--response` tokens, with the peak memory each needs beyond what the process held before them.

Run as a plain `python` subprocess per length by tests/test_long_sequences.py (a fresh process per length, so one
length's high-water mark never hides the next one's); prints one JSON line. Memory: the resident set's high-water
mark during the pass (VmHWM, reset before it) minus the resident set just before it, as mppo bench long-context
measures it (mppo.bench.long_context.PeakMemory). Before, the lifetime high-water mark (ru_maxrss) was read: when
the model's build had peaked higher than a short pass, the pass was charged that old peak (CI: 2k and 4k both ~57
MB, so 8k looked like 2.8x 4k). With `--hf-check` the actor's log-probs are also compared with HF transformers'
(SDPA attention, fp32) on the same sequence, after the memory was measured.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def make_batch(vocab: int, prompt: int, response: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row in the workers' data contract: a prompt with no padding and a response of exactly `response` tokens."""
    g = torch.Generator().manual_seed(seed)
    total = prompt + response
    ids = torch.randint(1, vocab, (1, total), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(1, total, dtype=torch.long),
            "position_ids": torch.arange(total)[None], "responses": ids[:, prompt:].clone(),
            "response_mask": torch.ones(1, response), "advantages": torch.randn(1, response, generator=g)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--prompt", type=int, required=True)
    p.add_argument("--response", type=int, required=True)
    p.add_argument("--impl", default="sdpa")
    p.add_argument("--hf-check", action="store_true")
    opts = p.parse_args()

    from mppo.bench.long_context import PeakMemory
    from mppo.config.schema import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker

    dims = init_distributed(1, 1, seed=0)
    cfg = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, logprob_impl="fused",
                      kernel_backend="torch", optim=OptimConfig(lr=1e-4, weight_decay=0.0),
                      megatron=MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                              use_distributed_optimizer=False, recompute="none", seed=0))
    actor = ActorWorker(ModelConfig(transformer_impl=opts.impl, dtype="fp32"), cfg, dims, opts.hf, total_steps=1)
    batch = make_batch(read_hf_config(opts.hf).vocab_size, opts.prompt, opts.response)
    res: dict = {"tokens": opts.prompt + opts.response, "impl": opts.impl,
                 "core_attention": type(actor.model[0].module.decoder.layers[0].self_attention.core_attention).__name__}

    start = time.process_time()
    with PeakMemory(torch.device("cpu")) as memory:
        log_probs = actor.compute_log_prob(batch, temperature=1.0)
    res["log_prob_cpu_s"] = time.process_time() - start
    res["log_prob_extra_bytes"] = memory.result["extra_bytes"]
    batch["old_log_probs"] = log_probs
    start = time.process_time()
    with PeakMemory(torch.device("cpu")) as memory:
        metrics = actor.update(batch, temperature=1.0)
    res["update_cpu_s"] = time.process_time() - start
    res["update_extra_bytes"] = memory.result["extra_bytes"]
    res["grad_norm"] = metrics["actor/grad_norm"]
    res["skipped"] = metrics["skipped"]
    res["log_probs_finite"] = bool(torch.isfinite(log_probs).all())

    if opts.hf_check:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(opts.hf, attn_implementation="sdpa", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(input_ids=batch["input_ids"]).logits[0, opts.prompt - 1:-1].float()
        ref = torch.log_softmax(logits, dim=-1).gather(-1, batch["responses"][0, :, None]).squeeze(-1)
        res["log_probs_vs_hf"] = (log_probs[0] - ref).abs().max().item()
    destroy(process_group=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
