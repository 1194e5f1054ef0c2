"""Device cases of scale-out parallelism, run by tests/gpu/run_device_checks.sh (stage "parallel"):

  sp    `torchrun --nproc_per_node 2 parallel_checks.py sp OUT` (TP2: one GPU per rank, nccl): a tiny Qwen2 at TP2
        with sequence parallelism vs HF transformers on the same GPU, fp32: logits, log-probs and entropy (torch and
        Triton log-prob kernels) and the first/final norms' gradients through megatron's schedule; TP2 without SP
        on the same weights as a second reference (SP only moves where activations live).
  long  `python parallel_checks.py long OUT` (one GPU): `mppo plan` of one 32k-token sequence (1k prompt + 31k
        response) on a Qwen2.5-0.5B-shaped actor (random weights, fp32, SDPA spec) at CP1, then that sequence
        through the actor's old-log-prob pass: the pass's peak device memory against the plan's working set for it,
        and its log-probs against HF transformers' (SDPA, fp32) on the same GPU.

The models are written under $MPPO_PARALLEL_WORK (default: the temp dir). Each mode prints one JSON line (rank 0 under torchrun), writes it to OUT/parallel_<mode>.json and exits 1 when a
bound fails. Without CUDA both run on CPU (gloo; `TRITON_INTERPRET=1` for the Triton kernel) with a tiny shape and
a short sequence, to check this script's logic: no memory bound there (the plan models device memory).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "dist"), str(HERE.parent)]
from models_fixtures import make_hf_model  # noqa: E402
from models_parallel import TEMPERATURE, hf_reference, max_diff, micro_batches  # noqa: E402
from next_token import next_token_loss_step, token_logits, token_logprobs  # noqa: E402

ON_GPU = torch.cuda.is_available()
FP32_BOUND = 1e-3  # megatron vs HF in fp32 on one GPU (tests/gpu/test_gpu_megatron.py's bound)
LONG = (1024, 31744) if ON_GPU else (64, 192)  # (prompt, response): 32k tokens on a GPU (the model's 32k positions)
# The planner must not under-estimate: a pass that needs more than this factor x the plan (+ slack for the
# allocator's rounding) means `mppo plan` can call a config fitting that does not.
PLAN_FACTOR, PLAN_SLACK = 1.5, 512 << 20
# The models (~2 GB for the 0.5B shape) go here, not under OUT: OUT comes back from the device.
WORK = Path(os.environ.get("MPPO_PARALLEL_WORK", Path(tempfile.gettempdir()) / "mppo-parallel-checks"))


def norm_grad_diff(chunks, batches, hf) -> float:
    """tests/dist/models_parallel.final_norm_grad_diff with megatron's TP all-reduce of the grads that sequence
    parallelism leaves partial (the norms': each TP rank saw its slice of the sequence), which finalize_model_grads
    does in training and a bare schedule run does not: the first and final norms' grads through the schedule for
    loss = sum(log-probs) + 0.1 sum(entropy), relative to HF autograd's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mppo.workers.pipeline import run_pipeline

    vocab = hf.config.vocab_size
    inputs, step = next_token_loss_step(chunks, batches, vocab_size=vocab, temperature=TEMPERATURE,
                                        entropy_coeff=0.1)
    for c in chunks:
        c.zero_grad(set_to_none=True)
    run_pipeline(chunks, inputs, step, forward_only=False)
    for p in (p for c in chunks for p in c.parameters() if getattr(p, "sequence_parallel", False)):
        dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
    hf.zero_grad(set_to_none=True)
    total = 0.0
    for mb in batches:
        logp = torch.log_softmax(hf(mb["input_ids"]).logits.float() / TEMPERATURE, dim=-1)
        lp = logp[:, :-1].gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        total = total + lp.sum() + 0.1 * (-(logp.exp() * logp).sum(-1)[:, :-1]).sum()
    total.backward()
    pairs = [(chunks[0].decoder.final_layernorm.weight.grad, hf.model.norm.weight.grad),
             (chunks[0].decoder.layers[0].input_layernorm.weight.grad, hf.model.layers[0].input_layernorm.weight.grad)]
    return max((got - ref).abs().max().item() / ref.abs().max().item() for got, ref in pairs)


def sp_case(out: Path) -> dict:
    import torch.distributed as dist

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import load_hf_weights
    from mppo.parallel import destroy, init_distributed

    dims = init_distributed(2, 1, seed=1234)
    work = WORK / "sp"
    if dims.rank == 0:
        make_hf_model("qwen2_untied", work / "qwen2_untied")
    dist.barrier()
    from models_fixtures import load_hf_model

    device = dims.device
    hf = load_hf_model(work / "qwen2_untied").to(device)
    args = read_hf_config(work / "qwen2_untied")
    batches = [{k: v.to(device) for k, v in mb.items()} for mb in micro_batches(args.vocab_size, seed=11)]
    refs = hf_reference(hf, batches)
    res: dict = {"world": dist.get_world_size(), "backend": dims.backend, "device": str(device)}
    outs = {}
    for sp in (True, False):
        tag = "tp2_sp" if sp else "tp2"
        chunks = build_gpt_model(args, dims, role="actor", dtype=torch.float32, transformer_impl="sdpa",
                                 sequence_parallel=sp)
        load_hf_weights(chunks, work / "qwen2_untied", args)
        res[f"{tag}/sequence_parallel"] = chunks[0].config.sequence_parallel
        logits = token_logits(chunks, batches, args.vocab_size)
        lp = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
        fused = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE,
                               impl="fused", kernel_backend="triton")
        outs[tag] = lp
        res[f"{tag}/logits"] = max_diff(logits, refs, "logits")
        res[f"{tag}/log_probs"] = max_diff(lp, refs, "log_probs")
        res[f"{tag}/entropy"] = max_diff(lp, refs, "entropy")
        res[f"{tag}/triton_log_probs"] = max_diff(fused, refs, "log_probs")
        res[f"{tag}/norm_grads"] = norm_grad_diff(chunks, batches, hf)
        del chunks
    res["sp_vs_plain_tp/log_probs"] = max_diff(outs["tp2_sp"], outs["tp2"], "log_probs")
    destroy(process_group=True)
    bounds = {k: FP32_BOUND for k in res if k.endswith(("logits", "log_probs", "entropy", "norm_grads"))}
    res["failed"] = [k for k, bound in bounds.items() if not res[k] <= bound]
    if not res["tp2_sp/sequence_parallel"] or res["tp2/sequence_parallel"]:
        res["failed"].append("sequence_parallel flags")
    return res


def _long_model(work: Path) -> Path:
    """An HF checkpoint with random weights: Qwen2.5-0.5B's architecture on a GPU, a tiny Qwen2 on CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mppo.plan import known_config

    raw = known_config("Qwen2.5-0.5B")[1] if ON_GPU else {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "tie_word_embeddings": True}
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "torch_dtype")}
    torch.manual_seed(0)
    path = work / "long"
    AutoModelForCausalLM.from_config(Qwen2Config(**fields), dtype=torch.float32).save_pretrained(path)
    return path


def _plan(model: Path) -> dict:
    """`mppo plan`'s figures for this one-GPU run: the old-log-prob working set, and the whole verdict."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import plan

    prompt, response = LONG
    cfg = load_config(None, [
        "trainer.nnodes=1", "trainer.n_gpus_per_node=1", f"trainer.device={'cuda' if ON_GPU else 'cpu'}",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.dtype=fp32",
        "actor_rollout_ref.model.transformer_impl=sdpa", f"data.max_prompt_length={prompt}",
        f"data.max_response_length={response}", "data.train_batch_size=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=cpu", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.context_parallel_size=1"])
    p = plan(cfg, read_hf_config(model), device="h200" if ON_GPU else "cpu")
    return {"planned_old_log_prob_bytes": p.training_phases["old_log_prob"], "planned_fits": p.fits_training,
            "planned_logprob_tokens": p.logprob.tokens, "planned_sequence_len": p.sequence_len}


def long_case(out: Path) -> dict:
    from long_sequence import make_batch
    from transformers import AutoModelForCausalLM

    from mppo.config.schema import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker

    model = _long_model(WORK)
    res: dict = _plan(model)
    dims = init_distributed(1, 1, seed=0)
    cfg = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, logprob_impl="fused",
                      kernel_backend="auto", optim=OptimConfig(lr=1e-4, weight_decay=0.0),
                      megatron=MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                              context_parallel_size=1, use_distributed_optimizer=False,
                                              recompute="none", seed=0))
    actor = ActorWorker(ModelConfig(transformer_impl="sdpa", dtype="fp32"), cfg, dims, model, total_steps=1)
    prompt, response = LONG
    batch = {k: v.to(dims.device) for k, v in make_batch(read_hf_config(model).vocab_size, prompt, response).items()}
    res["tokens"] = prompt + response
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    log_probs = actor.compute_log_prob(batch, temperature=1.0)
    if ON_GPU:
        torch.cuda.synchronize()
        res["measured_old_log_prob_bytes"] = torch.cuda.max_memory_allocated() - before
        res["measured_over_planned"] = res["measured_old_log_prob_bytes"] / res["planned_old_log_prob_bytes"]
    res["log_probs_finite"] = bool(torch.isfinite(log_probs).all())
    del actor
    destroy(process_group=True)
    if ON_GPU:
        torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", dtype=torch.float32).to(
        batch["input_ids"].device).eval()
    with torch.no_grad():  # the response's log-probs only: [response, vocab] fp32, not the whole sequence's logits
        hidden = hf.model(input_ids=batch["input_ids"]).last_hidden_state[0, prompt - 1:-1]
        ref = torch.log_softmax(hf.lm_head(hidden).float(), dim=-1).gather(
            -1, batch["responses"][0, :, None]).squeeze(-1)
    res["log_probs_vs_hf"] = (log_probs[0] - ref).abs().max().item()
    res["failed"] = [k for k, ok in (("log_probs_vs_hf", res["log_probs_vs_hf"] <= FP32_BOUND),
                                     ("log_probs_finite", res["log_probs_finite"]),
                                     ("planned_fits", res["planned_fits"])) if not ok]
    if ON_GPU and res["measured_old_log_prob_bytes"] > PLAN_FACTOR * res["planned_old_log_prob_bytes"] + PLAN_SLACK:
        res["failed"].append("measured_old_log_prob_bytes")  # the plan under-estimates this pass
    return res


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    res = {"sp": sp_case, "long": long_case}[mode](out)
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(res, default=str)
        (out / f"parallel_{mode}.json").write_text(line + "\n")
        print(line)
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
