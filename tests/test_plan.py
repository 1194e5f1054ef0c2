"""`mppo plan`: parameter counts against public numbers and HF transformers, model-state bytes against what
megatron-core actually allocates (a CPU run), activation memory against Korthikanti et al. 2022's closed form,
KV cache and FLOPs against hand computations, every recipe in configs/, the CLI, and bench/PLANS.md freshness.

Run as a script (`python tests/test_plan.py MEASURE`), this file is also the child process of the megatron check:
it builds tiny models with mppo's builders and optimizer and prints the bytes they allocate as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30
TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False}
# (role, dtype, distributed optimizer, tie_word_embeddings) measured in one megatron process
MEASURED_CASES = [("actor", "fp32", False, False), ("actor", "bf16", True, True), ("critic", "bf16", False, False),
                  ("actor", "bf16", False, False)]


# -------------------------------------------------------------------------------- the megatron child process
def _measure() -> None:
    import torch

    from mppo.config.schema import OptimConfig
    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.optim import build_optimizer, wrap_with_ddp

    dims = init_distributed(1, 1)
    results = []
    for role, dtype_name, distributed, tie in MEASURED_CASES:
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        args = read_hf_config({**TINY, "tie_word_embeddings": tie})
        chunks = build_gpt_model(args, dims, role=role, dtype=dtype)
        ddp = wrap_with_ddp(chunks, use_distributed_optimizer=distributed)
        optimizer = build_optimizer(ddp, OptimConfig(lr=1e-3), use_distributed_optimizer=distributed, dtype=dtype)
        for chunk in ddp:  # a step creates Adam's lazily allocated moments
            for p in chunk.parameters():
                p.main_grad.fill_(1e-3)
        optimizer.step()
        params = {id(p): p for chunk in chunks for p in chunk.parameters()}
        model_storages = {p.untyped_storage().data_ptr() for p in params.values()}
        grads = [buf.grad_data for chunk in ddp for buf in chunk.buffers + chunk.expert_parallel_buffers]
        model_storages |= {g.untyped_storage().data_ptr() for g in grads}
        model_storages |= {buf.param_data.untyped_storage().data_ptr() for chunk in ddp for buf in chunk.buffers
                           if buf.param_data is not None}
        opt_bytes, seen = 0, set()
        torch_optimizers = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        for opt in torch_optimizers:
            tensors = [p for g in opt.param_groups for p in g["params"]
                       if p.untyped_storage().data_ptr() not in model_storages]  # fp32 master copies
            tensors += [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
            for t in tensors:
                key = (t.data_ptr(), t.numel())
                if key not in seen and t.numel() > 1:  # scalar `step` counters are not optimizer state
                    seen.add(key)
                    opt_bytes += t.numel() * t.element_size()
        results.append({"role": role, "dtype": dtype_name, "distributed": distributed, "tie": tie,
                        "params": sum(p.numel() for p in params.values()),
                        "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
                        "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
                        "optimizer_bytes": opt_bytes})
    destroy(process_group=True)
    print("RESULT " + json.dumps(results))


# ------------------------------------------------------------------------------------------------- helpers
def _layout(role="actor", tp=1, pp=1, vpp=None, dp=1, distributed=False, recompute="none", micro=1.0, m=1):
    from mppo.plan.memory import RoleLayout

    return RoleLayout(role=role, tp=tp, pp=pp, vpp=vpp, dp=dp, distributed_optimizer=distributed,
                      recompute=recompute, micro_batch=micro, forward_micro_batch=micro, micro_batches_per_step=m,
                      trains=role != "ref", offloaded=False)


def _run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    """`mppo plan ARGV` through the real CLI dispatch, in this process: (exit code, stdout, stderr)."""
    from mppo.cli import main

    capsys.readouterr()
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------------------ parameter counts
def test_builtin_param_counts_match_public_numbers():
    """Model-card parameter counts (Qwen2.5 cards, Meta's Llama 3 card): within 1%."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.catalog import known_config
    from mppo.plan.memory import total_params

    public = {"Qwen2.5-0.5B": 0.49e9, "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-3B": 3.09e9, "Qwen2.5-7B": 7.61e9,
              "Qwen2.5-32B": 32.76e9, "Llama-3-8B": 8.03e9, "Qwen3-30B-A3B": 30.5e9}
    for name, count in public.items():
        got = total_params(read_hf_config(known_config(name)[1]))
        assert abs(got - count) / count < 0.01, (name, got, count)
    # the exact figure another public tool computes for Qwen2.5-32B's config
    assert total_params(read_hf_config(known_config("Qwen/Qwen2.5-32B-Instruct")[1])) == 32_763_876_352


def test_param_counts_match_transformers():
    """HF transformers' own modules (built on the meta device) have exactly the planner's count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mppo.models.hf_config import read_hf_config
    from mppo.plan.catalog import known_config
    from mppo.plan.memory import total_params

    for name in ("Qwen2.5-0.5B", "Llama-3-8B", "Qwen3-0.6B", "Qwen3-30B-A3B", "SmolLM2-135M-Instruct"):
        raw = known_config(name)[1]
        hf = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                         if k not in ("model_type", "torch_dtype")})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        assert sum(p.numel() for p in model.parameters()) == total_params(read_hf_config(raw)), name


def test_model_state_bytes_match_megatron_allocations():
    """Weights, fp32 grad buffer and Adam state (+ fp32 master) as allocated by megatron-core through mppo's
    builders and optimizer on CPU (TP1, one process) are within 10% of the planner's bytes."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.memory import Precision, model_state

    proc = subprocess.run([sys.executable, str(Path(__file__)), "MEASURE"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    measured = json.loads(line[0][len("RESULT "):])
    assert len(measured) == len(MEASURED_CASES)
    for m in measured:
        args = read_hf_config({**TINY, "tie_word_embeddings": m["tie"]})
        prec = Precision.for_dtype(4 if m["dtype"] == "fp32" else 2, flash_attention=False)
        state = model_state(args, _layout(m["role"], distributed=m["distributed"]), prec, stage=0)
        for planned, actual in ((state.weights, m["param_bytes"]), (state.grads, m["grad_bytes"]),
                                (state.optimizer, m["optimizer_bytes"])):
            assert abs(planned - actual) <= 0.1 * actual, (m, state)
        assert state.params == m["params"], (m, state)  # the count itself is exact


# ---------------------------------------------------------------------------------------------- activations
def test_activations_equal_korthikanti_closed_form():
    """With MHA, a SwiGLU width F = 8h/3 (so 3F = the paper's 4h + 4h) and unfused attention, the itemised
    formula is the paper's s·b·h·(10 + 24/t + 5as/(ht)) minus what dropout 0 removes: the two 1-byte masks per
    token (2sbh) and, of the 5as²b/t, the score mask (as²b/t) and the dropout output (2as²b/t)."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.memory import Precision, layer_activation_bytes

    h, a, s, b = 768, 12, 1024, 2
    args = read_hf_config({"model_type": "llama", "hidden_size": h, "intermediate_size": 8 * h // 3,
                           "num_hidden_layers": 2, "num_attention_heads": a, "num_key_value_heads": a,
                           "vocab_size": 1000})
    prec = Precision.for_dtype(2, flash_attention=False)
    for t in (1, 2, 4):
        paper_none = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        paper_selective = s * b * h * (10 + 24 / t)
        dropout = 2 * s * b * h
        assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "none"),
                            paper_none - dropout - 3 * a * s * s * b / t)
        assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "selective"), paper_selective - dropout)
        assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "full"), 2 * s * b * h)
        # with sequence parallelism (the paper's "TP + SP" rows): 10 + 24/t -> 34/t, and the layer input / t
        paper_sp_none = s * b * h * (34 / t + 5 * a * s / (h * t))
        assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "none", sp=True),
                            paper_sp_none - dropout / t - 3 * a * s * s * b / t)
        assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "selective", sp=True),
                            s * b * h * 34 / t - dropout / t)
        assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "full", sp=True), 2 * s * b * h / t)


def test_context_parallel_activations_equal_the_closed_form_at_the_local_sequence():
    """CP splits each sequence into 2·CP chunks, two per rank: a layer keeps Korthikanti's bytes for s/CP tokens,
    with the unfused scores of s/CP queries against all s keys (so every row scales as 1/CP), with and without SP;
    the all-gathered K/V of one layer (GQA: 2 of 6 heads) and, in the backward, their gradients, by hand."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.memory import Precision, cp_kv_gather_bytes, layer_activation_bytes

    h, a, s, b = 768, 12, 1024, 2
    args = read_hf_config({"model_type": "llama", "hidden_size": h, "intermediate_size": 8 * h // 3,
                           "num_hidden_layers": 2, "num_attention_heads": a, "num_key_value_heads": a,
                           "vocab_size": 1000})
    prec = Precision.for_dtype(2, flash_attention=False)
    for cp in (1, 2, 4, 8):
        local = s / cp  # tokens of this rank's two chunks
        for t in (1, 2, 4):
            # the other ranks' K/V, gathered and kept by the attention (all heads are K/V heads here), bf16
            gathered = 2 * b * (s - local) * a * (h // a) * 2 / t
            dropout = 2 * local * b * h  # the paper's dropout masks, which mppo's models do not have
            scores_gone = 3 * a * local * s * b / t  # of 5as²b/t: the score mask and the dropout output
            paper_none = local * b * h * (10 + 24 / t) + 5 * a * local * s * b / t
            assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "none", cp=cp),
                                paper_none - dropout - scores_gone + gathered)
            assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "selective", cp=cp),
                                local * b * h * (10 + 24 / t) - dropout)
            assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "full", cp=cp), 2 * local * b * h)
            paper_sp_none = local * b * h * 34 / t + 5 * a * local * s * b / t
            assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "none", sp=True, cp=cp),
                                paper_sp_none - dropout / t - scores_gone + gathered)
            assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "selective", sp=True, cp=cp),
                                local * b * h * 34 / t - dropout / t)
            assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "full", sp=True, cp=cp),
                                2 * local * b * h / t)
    gqa = read_hf_config({"model_type": "qwen2", "hidden_size": 384, "intermediate_size": 1024,
                          "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
                          "vocab_size": 1000})  # head_dim 64
    kv = 2 * s * b * 2 * 64 * 2  # K and V, every token, both KV heads, bf16
    for t in (1, 2):
        assert cp_kv_gather_bytes(gqa, t, s, b, prec, 1, backward=True) == 0
        assert cp_kv_gather_bytes(gqa, t, s, b, prec, 4, backward=False) == kv / t
        assert cp_kv_gather_bytes(gqa, t, s, b, prec, 4, backward=True) == 2 * kv / t  # + dK, dV before the scatter


def test_context_parallel_training_peak_and_optimizer_shards():
    """Under CP the stage's stored activations are CP1's / CP plus every layer's gathered K/V (SDPA keeps them for
    the backward), the peak adds one layer's dK/dV (and with selective recomputation its K/V gathered again),
    and the distributed optimizer shards over DP x CP (megatron's data-parallel group with context parallelism)."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.memory import Precision, cp_kv_gather_bytes, model_state, training_activations

    args = read_hf_config(TINY)
    prec = Precision.for_dtype(2, flash_attention=True)
    cp1 = _layout(dp=4, distributed=True, micro=2)
    cp2 = dataclasses.replace(cp1, dp=2, cp=2)
    per1, peak1 = training_activations(args, cp1, prec, 4096, stage=0)
    per2, peak2 = training_activations(args, cp2, prec, 4096, stage=0)
    # stored: CP1's / 2 plus, in every layer, the other rank's half of K and V (2 of 4 heads are K/V heads, bf16)
    other_kv = 2 * 2 * (4096 // 2) * 2 * (64 // 4) * 2
    assert math.isclose(per2, per1 / 2 + other_kv * args.num_layers)
    # the peak: one layer's full-length dK/dV in its backward on top
    dkv = cp_kv_gather_bytes(args, 1, 4096, 2, prec, 2, backward=False)
    assert math.isclose(peak2, peak1 / 2 + other_kv * args.num_layers + dkv)
    sel1, sel2 = (dataclasses.replace(lay, recompute="selective") for lay in (cp1, cp2))
    _, speak1 = training_activations(args, sel1, prec, 4096, stage=0)
    _, speak2 = training_activations(args, sel2, prec, 4096, stage=0)  # regathered in the backward: K/V + dK/dV
    assert math.isclose(speak2, speak1 / 2 + cp_kv_gather_bytes(args, 1, 4096, 2, prec, 2, backward=True))
    state1, state2 = model_state(args, cp1, prec, 0), model_state(args, cp2, prec, 0)
    assert (state2.weights, state2.grads, state2.optimizer) == (state1.weights, state1.grads, state1.optimizer)
    assert state2.optimizer == math.ceil(state2.optimizer_unsharded / 4)


def test_moe_layer_activations_hand_count():
    """A Qwen3-MoE layer (8 experts, top-2, expert width 48) keeps, per token, hand-counted: the two norms' and the
    QKV projection's inputs (3h), the k dispatched expert inputs (2h) and the router's fp32 scores (8 x 4 bytes);
    split over TP: Q, K, V and the attention output (head_dim 16: 8 + 2 x 2 + 8 heads' worth) and each expert's
    SwiGLU fc1 output (2 x 48) and fc2 input (48) for both chosen experts; with flash attention a log-sum-exp per
    head. The dense layer (mlp_only_layers) keeps its own SwiGLU (3 x 96). The stage's mean enters the peak."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.memory import Precision, RoleLayout, layer_activation_bytes, training_activations

    args = read_hf_config({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
                           "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
                           "num_hidden_layers": 4, "mlp_only_layers": [3], "num_attention_heads": 8,
                           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000})
    prec = Precision.for_dtype(2, flash_attention=True)
    s, b, t = 100, 3, 2
    tokens = s * b
    moe_per_token = (3 * 64 + 2 * 64) * 2 + 8 * 4 + ((8 + 4 + 8) * 16 + 2 * 3 * 48) * 2 / t + 8 * 4 / t
    dense_per_token = 4 * 64 * 2 + ((8 + 4 + 8) * 16 + 3 * 96) * 2 / t + 8 * 4 / t
    assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "none", moe=True), tokens * moe_per_token)
    assert math.isclose(layer_activation_bytes(args, t, s, b, prec, "none"), tokens * dense_per_token)
    lay = RoleLayout(role="actor", tp=t, pp=1, vpp=None, dp=2, distributed_optimizer=True, recompute="none",
                     micro_batch=b, forward_micro_batch=b, micro_batches_per_step=2, trains=True, offloaded=False,
                     ep=2)
    per_micro, peak = training_activations(args, lay, prec, s, stage=0)
    assert math.isclose(per_micro, tokens * (3 * moe_per_token + dense_per_token))
    assert math.isclose(peak, per_micro)  # PP 1: one micro-batch's layers


def test_pipeline_in_flight_matches_paper_factor():
    """1F1B: stage 0 holds p micro-batches of L/p layers = L layers; interleaved: L·(1 + (p-1)/(p·v))."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.memory import layers_in_flight

    args = read_hf_config({**TINY, "num_hidden_layers": 64})
    assert layers_in_flight(args, _layout(pp=4, m=100), 0) == 64
    assert layers_in_flight(args, _layout(pp=4, m=100), 3) == 16
    assert layers_in_flight(args, _layout(pp=4, m=2), 0) == 32  # only 2 micro-batches to keep in flight
    assert layers_in_flight(args, _layout(pp=4, vpp=2, m=100), 0) == 64 * (1 + 3 / 8)
    assert layers_in_flight(args, _layout(pp=1, m=100), 0) == 64


def test_logprob_working_sets():
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.catalog import known_config
    from mppo.plan.memory import Precision, logprob_bytes

    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    prec = Precision.for_dtype(2, flash_attention=True)
    tokens = 4 * 2048
    naive = logprob_bytes(args, 2, tokens, prec, fused=False)
    assert naive == tokens * (152064 // 2) * (2 + 3 * 4)  # bf16 logits + 3 fp32 copies of [tokens x V/2]
    fused = logprob_bytes(args, 2, tokens, prec, fused=True)
    assert fused == 3 * (1 << 22) * 4 + tokens * 16 and fused < naive / 100


def test_kv_cache_and_flops_by_hand():
    from mppo.models.hf_config import read_hf_config
    from mppo.plan.catalog import known_config
    from mppo.plan.memory import kv_bytes_per_token
    from mppo.plan.timing import training_flops

    q7 = read_hf_config(known_config("Qwen2.5-7B")[1])
    assert kv_bytes_per_token(q7, 2, 2) == 2 * 28 * (4 // 2) * 128 * 2  # K+V x layers x heads/GPU x dim x bf16
    assert kv_bytes_per_token(q7, 8, 2) == 2 * 28 * 1 * 128 * 2  # 4 KV heads over 8 GPUs: replicated, 1 each
    # 6·N·T with N = the layers' matmul params (biases included) + the output layer, plus causal attention
    # 6·L·a·d·s per token (fwd: QKᵀ and AV at mean context s/2, 2 FLOPs per MAC)
    tokens, seq = 1000, 100
    h, kv, f = 3584, 512, 18944
    n = 28 * (2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * f + 2 * h) + 152064 * h
    expected = 6 * n * tokens + 6 * 28 * 28 * 128 * seq * tokens
    assert math.isclose(training_flops(q7, _layout(), tokens, seq, epochs=1), expected, rel_tol=1e-9)
    assert math.isclose(training_flops(q7, _layout(recompute="full"), tokens, seq, epochs=2), 2 * expected * 4 / 3)


def test_lora_actor_state_is_frozen_base_plus_fp32_adapters_by_hand(capsys):
    """A LoRA actor (Qwen2.5-7B, TP2 DP4, distributed optimizer): the base counts as bf16 weights only, the adapters
    (counted here from rank and the projections' shapes) as fp32 weights + fp32 grads + fp32 Adam m, v over DP 4;
    no reference model; activations as full fine-tuning; the text prints LoRA vs full fine-tuning."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan
    from mppo.plan.memory import stage_params

    q7 = read_hf_config(known_config("Qwen2.5-7B")[1])
    recipe = str(REPO / "configs/gsm8k_qwen2.5_7b_grpo.yaml")
    full = plan(load_config(recipe, ["actor_rollout_ref.actor.use_kl_loss=true"]), q7)
    r, h, q, kv, f, layers, tp, dp = 32, 3584, 28 * 128, 4 * 128, 18944, 28, 2, 4
    # per layer on one TP rank, A [r, in] and B [out, r]: q/k/v and gate/up split B's rows over TP, o and down A's
    # columns
    per_layer = (r * h + q // tp * r) + 2 * (r * h + kv // tp * r) + (r * q // tp + h * r) \
        + 2 * (r * h + f // tp * r) + (r * f // tp + h * r)
    adapters = layers * per_layer
    cases = {("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"): adapters,
             ("q_proj", "v_proj"): layers * ((r * h + q // tp * r) + (r * h + kv // tp * r))}
    for targets, n in cases.items():
        lora = plan(load_config(recipe, ["actor_rollout_ref.actor.use_kl_loss=true",
                                         "actor_rollout_ref.model.lora.rank=32",
                                         f"actor_rollout_ref.model.lora.target_modules=[{','.join(targets)}]"]), q7)
        actor = lora.roles[0]
        assert [x.layout.role for x in lora.roles] == ["actor"]  # the reference is the actor's base
        base = stage_params(q7, actor.layout, 0)
        assert actor.state.adapter_params == n
        assert actor.state.params == base == full.roles[0].state.params
        assert actor.state.weights == base * 2 + n * 4  # bf16 base + fp32 adapters
        assert actor.state.grads == n * 4 and actor.state.optimizer == math.ceil(n * 2 * 4 / dp)
        assert actor.activations_peak == full.roles[0].activations_peak
        assert lora.training_phases == {k: v for k, v in full.training_phases.items() if k != "ref"}
        assert lora.full_finetune is not None and lora.full_finetune.resident == full.resident
        assert lora.full_finetune.training_peak == full.training_peak
        assert lora.resident < full.resident
    assert full.full_finetune is None and [x.layout.role for x in full.roles] == ["actor", "ref"]
    code, out, _ = _run_plan(capsys, recipe, "--hf-config", "auto", "actor_rollout_ref.model.lora.rank=32")
    assert code == 0 and "LoRA vs full fine-tuning per GPU: resident" in out
    assert "fp32 adapter grads only" in out and f"{adapters / 1e6:.2f}M adapter params" in out


def test_lora_on_moe_experts_by_hand():
    """Qwen3-30B-A3B (48 MoE layers, 128 experts of width 768) at TP2 x EP8 on 16 GPUs (DP 8, expert-DP 1), LoRA
    rank 16 on every linear with whole experts: attention's adapters split over TP as dense ones, each of the 16
    local experts' gate/up/down adapters whole; the experts' Adam state over expert-DP (1), the rest over DP 8."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    moe = read_hf_config(known_config("Qwen3-30B-A3B")[1])
    lora = plan(load_config(str(REPO / "configs/qwen3_30b_a3b_grpo.yaml"), [
        "actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.target_modules=[all-linear]",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"]), moe)
    r, h, q, kv, e, layers, tp, local = 16, 2048, 32 * 128, 4 * 128, 768, 48, 2, 128 // 8
    attention = (r * h + q // tp * r) + 2 * (r * h + kv // tp * r) + (r * q // tp + h * r)
    experts = local * 3 * r * (h + e)
    actor = lora.roles[0]
    stages = actor.layout.pp
    assert actor.state.adapter_params == layers // stages * (attention + experts)
    per_stage = layers // stages
    adam, dp, expert_dp = 2 * 4, 8, 1  # fp32 m and v per adapter parameter
    assert actor.state.optimizer == (math.ceil(per_stage * attention * adam / dp)
                                     + math.ceil(per_stage * experts * adam / expert_dp))


# ------------------------------------------------------------------------------------------------- recipes
def _recipe_plans(tmp_path: Path, monkeypatch) -> dict:
    """Every config in configs/ planned (the GPU recipes on their built-in model configs)."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    run_dir = tmp_path / "demo"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setenv("RUN_DIR", str(run_dir))  # configs/demo_cpu.yaml reads its model from $RUN_DIR/model
    plans = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(str(path))
        if path.name == "demo_cpu.yaml":
            plans[path.name] = plan(cfg, read_hf_config(run_dir / "model"), device="cpu")
        elif path.name in ("demo.yaml", "countdown_tool_smollm2.yaml"):
            # the real-model recipes: SmolLM2-135M-Instruct, converted into $RUN_DIR/model
            plans[path.name] = plan(cfg, read_hf_config(known_config("SmolLM2-135M-Instruct")[1]), device="cpu")
        elif path.name == "ppo_trainer.yaml":
            plans[path.name] = plan(cfg, read_hf_config(known_config("Qwen2.5-0.5B")[1]))
        else:
            plans[path.name] = plan(cfg, read_hf_config(known_config(cfg.actor_rollout_ref.model.path)[1]))
    return plans


def test_every_recipe_plans_with_sensible_numbers(tmp_path, monkeypatch):
    plans = _recipe_plans(tmp_path, monkeypatch)
    assert set(plans) == {p.name for p in (REPO / "configs").glob("*.yaml")}
    for name, p in plans.items():
        assert p.training_peak > p.resident > 0, name
        assert p.step is None or 0 < p.step.total_s < 3600, name
    big = plans["qwen2.5_32b_4node.yaml"]
    actor = big.roles[0]
    assert (actor.layout.tp, actor.layout.pp, actor.layout.vpp, actor.layout.dp) == (8, 4, 2, 1)
    assert abs(actor.state.weights - 32.8e9 * 2 / 32) < 0.1 * 32.8e9 * 2 / 32  # bf16 weights over 32 GPUs
    assert actor.state.grads == 2 * actor.state.weights and actor.state.optimizer == 6 * actor.state.weights
    ref = next(r for r in big.roles if r.layout.role == "ref")
    assert ref.state.weights == 0 and ref.state.host_weights == actor.state.weights  # offload_to_cpu: true
    assert big.fits  # H100
    small = plans["countdown_qwen2.5_3b_ppo.yaml"]
    assert [r.layout.role for r in small.roles] == ["actor", "critic", "ref"]
    assert abs(small.roles[0].state.weights - 3.09e9 * 2 / 2) < 0.05 * 3.09e9
    gsm = plans["gsm8k_qwen2.5_7b_grpo.yaml"]
    actor7 = gsm.roles[0]
    assert actor7.layout.dp == 4 and actor7.state.optimizer == math.ceil(actor7.state.optimizer_unsharded / 4)
    moe = plans["qwen3_30b_a3b_grpo.yaml"]
    lay = moe.roles[0].layout
    assert (lay.tp, lay.ep, lay.dp, lay.sp, moe.world) == (2, 8, 8, True, 16) and moe.moe.experts_per_rank == 16
    assert moe.fits  # H100
    long = plans["qwen2_5_7b_grpo_32k_cp.yaml"]
    lay = long.roles[0].layout
    assert (lay.tp, lay.cp, lay.dp, lay.sp, long.sequence_len) == (2, 4, 1, True, 32768)
    assert long.fits and long.logprob.tokens == 32768 / 4  # H100; each rank scores its 1/CP of the sequence
    lora = plans["qwen2_5_7b_grpo_lora.yaml"]  # one GPU: the frozen bf16 base, fp32 adapters, no reference model
    actor = lora.roles[0].state
    assert [r.layout.role for r in lora.roles] == ["actor"] and lora.world == 1 and lora.fits  # H100
    assert actor.grads == actor.adapter_params * 4 < 0.05 * actor.weights
    assert lora.full_finetune is not None and not lora.full_finetune.fits
    demo = plans["demo_cpu.yaml"]
    assert demo.dtype == "fp32" and demo.step is None and demo.fits
    # a CPU rank: the process, and the CPU engine's fp32 weights (134,515,008 parameters, transformers' count of the
    # real model) kept through training; glibc keeps one more update working set (tests/test_real_model.py
    # compares the whole figure with a measured run)
    real = plans["demo.yaml"]
    assert real.engine_resident == 134_515_008 * 4 and real.runtime_reserve > 0
    assert real.allocator_retained == real.training_phases["update_actor"] == max(real.training_phases.values())
    assert all(p.engine_resident == 0 and p.allocator_retained == 0 for p in plans.values() if p.device.peak_flops)


def test_the_scale_out_recipes_fit_h100_and_h200_nodes_and_need_their_cp():
    """configs/qwen3_30b_a3b_grpo.yaml, configs/qwen2_5_7b_grpo_32k_cp.yaml and the one-GPU LoRA recipe
    configs/qwen2_5_7b_grpo_lora.yaml fit both devices; the long-response
    recipe does not fit an H100 at CP1, and the planner's CP suggestion then fits."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    for name in ("qwen3_30b_a3b_grpo.yaml", "qwen2_5_7b_grpo_32k_cp.yaml", "qwen2_5_7b_grpo_lora.yaml"):
        cfg = load_config(str(REPO / "configs" / name))
        args = read_hf_config(known_config(cfg.actor_rollout_ref.model.path)[1])
        for device in ("h100", "h200"):
            assert plan(cfg, args, device=device).fits, (name, device)
    recipe = str(REPO / "configs/qwen2_5_7b_grpo_32k_cp.yaml")
    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    cp1 = plan(load_config(recipe, ["actor_rollout_ref.actor.megatron.context_parallel_size=1"]), args)
    assert not cp1.fits_training
    cp = [s for s in cp1.suggestions if "context_parallel_size" in s.overrides[0]]
    assert cp and cp[0].fits and cp[0].overrides[0].endswith("=2")


def test_suggestions_make_an_oversized_config_fit():
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    cfg = load_config(str(REPO / "configs/gsm8k_qwen2.5_7b_grpo.yaml"),
                      ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
                       "actor_rollout_ref.actor.megatron.recompute=none"])
    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    p = plan(cfg, args)
    assert not p.fits_training
    knobs = {o for s in p.suggestions for o in s.overrides}
    assert "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true" in knobs
    best = p.suggestions[0]
    assert best.fits and best.problem is None
    applied = load_config(str(REPO / "configs/gsm8k_qwen2.5_7b_grpo.yaml"),
                          ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
                           "actor_rollout_ref.actor.megatron.recompute=none", *best.overrides])
    assert plan(applied, args).fits


def _long_7b(*overrides: str):
    """The GSM8K 7B recipe with 32k-token responses, one sequence per micro-batch: too long for CP1 on an H100."""
    from mppo.config import load_config

    return load_config(str(REPO / "configs/gsm8k_qwen2.5_7b_grpo.yaml"),
                       ["data.max_response_length=32768", "data.train_batch_size=128",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", *overrides])


def test_a_sequence_too_long_for_one_rank_gets_the_smallest_context_parallelism_that_fits():
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    cp_keys = ("actor_rollout_ref.actor.megatron.context_parallel_size",
               "actor_rollout_ref.ref.megatron.context_parallel_size")
    p = plan(_long_7b(), args)
    assert p.roles[0].layout.cp == 1 and not p.fits_training
    cp = [s for s in p.suggestions if any(o.startswith(cp_keys[0]) for o in s.overrides)]
    assert len(cp) == 1 and cp[0].fits and cp[0].problem is None  # one CP suggestion: the smallest that fits
    assert cp[0].overrides == tuple(f"{k}=2" for k in cp_keys) and "TP2 PP1 CP2 DP2" in cp[0].why
    applied = plan(_long_7b(*cp[0].overrides), args)
    assert applied.fits and applied.roles[0].layout.dp == 2 and applied.logprob.tokens == (1024 + 32768) / 2
    assert applied.training_peak == cp[0].training_peak
    # on a smaller device CP2 is not enough: the smallest CP that fits is 4
    small = plan(_long_7b(), args, 70 * GiB)
    assert plan(_long_7b(*cp[0].overrides), args, 70 * GiB).fits_training is False
    cp = [s for s in small.suggestions if any(o.startswith(cp_keys[0]) for o in s.overrides)]
    assert cp[0].overrides == tuple(f"{k}=4" for k in cp_keys) and cp[0].fits
    assert plan(_long_7b(*cp[0].overrides), args, 70 * GiB).fits


def test_a_context_parallel_size_that_does_not_divide_the_world_is_refused(capsys):
    """As a TP that does not divide the world: a PlanError naming the key (the config validation may refuse it
    first, naming it too), and `mppo plan` exits 2 with one line."""
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan
    from mppo.plan.memory import PlanError

    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    bad = _long_7b()
    bad.actor_rollout_ref.actor.megatron.context_parallel_size = 3  # past the config validation
    with pytest.raises(PlanError, match=r"actor.megatron.context_parallel_size = 3: TP x PP x CP = 2 x 1 x 3 does "
                                        r"not divide the 8 GPUs"):
        plan(bad, args)
    code, out, err = _run_plan(capsys, str(REPO / "configs/qwen2_5_7b_grpo_32k_cp.yaml"), "--hf-config", "auto",
                               "actor_rollout_ref.actor.megatron.context_parallel_size=3")
    assert code == 2 and out == "" and "context_parallel_size" in err and err.count("\n") == 1, err


def test_step_time_has_no_old_log_prob_pass_when_the_trainer_reuses_the_update_forward():
    """The plan predicts what the trainer does: an on-policy step (one epoch, one mini-batch, no KL in the reward)
    has no separate old-log-prob forward; a second mini-batch brings it back at the cost of one actor forward."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    recipe = str(REPO / "configs/gsm8k_qwen2.5_7b_grpo.yaml")
    batch = load_config(recipe).data.train_batch_size
    on_policy = plan(load_config(recipe, [f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}"]), args).step
    two_minis = plan(load_config(recipe, [f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // 2}"]), args).step
    assert on_policy.old_log_prob_s == 0.0
    assert two_minis.old_log_prob_s == pytest.approx(two_minis.ref_s, rel=0.5) and two_minis.old_log_prob_s > 0
    assert two_minis.total_s > on_policy.total_s


def test_step_time_follows_rollout_correction_like_the_trainer():
    """IS weights or rejection need the old log-probs before the update (the pass comes back, as in the trainer);
    bypass mode takes them from the engine (no pass, even with two mini-batches)."""
    from mppo.config import load_config
    from mppo.config.decisions import OldLogProbSource, old_log_prob_source
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan

    args = read_hf_config(known_config("Qwen2.5-7B")[1])
    recipe = str(REPO / "configs/gsm8k_qwen2.5_7b_grpo.yaml")
    batch = load_config(recipe).data.train_batch_size
    rc = "algorithm.rollout_correction"
    for extra, has_pass in (([f"{rc}.rollout_is=token"], True), ([f"{rc}.rollout_rs=seq_mean_k3",
                                                                  f"{rc}.rollout_rs_threshold=0.01"], True),
                            ([f"{rc}.bypass_mode=true"], False),
                            ([f"{rc}.bypass_mode=true", f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // 2}"],
                             False)):
        cfg = load_config(recipe, [f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}", *extra])
        assert (old_log_prob_source(cfg) is OldLogProbSource.ACTOR_PASS) is has_pass, extra
        assert (plan(cfg, args).step.old_log_prob_s > 0) is has_pass, extra


# ------------------------------------------------------------------------------------------------------- CLI
def test_cli_text_json_and_errors(capsys):
    recipe = str(REPO / "configs/qwen2.5_32b_4node.yaml")
    code, out, err = _run_plan(capsys, recipe, "--hf-config", "auto")
    assert code == 0, err
    assert "verdict: FITS on H100" in out and "actor optimizer" in out and "step time" in out
    code, out, _ = _run_plan(capsys, recipe, "--hf-config", "Qwen2.5-32B", "--device", "h200", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["device"]["name"].startswith("H200") and data["step"]["total_s"] > 0
    code, out, _ = _run_plan(capsys, recipe, "--hf-config", "auto", "--device-memory", "16")
    assert code == 1 and "DOES NOT FIT" in out and "try " in out
    code, _, err = _run_plan(capsys, recipe)  # models/Qwen2.5-32B-Instruct is not downloaded here
    assert code == 2 and "--hf-config" in err and "config.json" in err
    code, _, err = _run_plan(capsys, recipe, "--hf-config", "Qwen9-1T")
    assert code == 2 and "Qwen2.5-7B" in err  # lists the built-in names
    code, _, err = _run_plan(capsys, recipe, "--hf-config", "auto", "trainer.n_gpus_per_node=16",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=16",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=16")
    assert code == 2 and "key/value heads" in err
    code, _, err = _run_plan(capsys, recipe, "--hf-config", "auto", "--mfu", "2")
    assert code == 2 and "--mfu" in err


def test_plans_md_is_up_to_date(tmp_path, capsys, monkeypatch):
    """bench/PLANS.md is what `mppo plan <GPU recipes> --hf-config auto --markdown` prints today."""
    recipes = ["configs/countdown_qwen2.5_3b_ppo.yaml", "configs/gsm8k_qwen2.5_7b_grpo.yaml",
               "configs/qwen2.5_32b_4node.yaml", "configs/qwen3_30b_a3b_grpo.yaml",
               "configs/qwen2_5_7b_grpo_32k_cp.yaml", "configs/qwen2_5_7b_grpo_lora.yaml"]
    monkeypatch.chdir(REPO)
    out = tmp_path / "PLANS.md"
    code, _, err = _run_plan(capsys, *recipes, "--hf-config", "auto", "--markdown", "--out", str(out))
    assert code == 0, err
    assert out.read_text() == (REPO / "bench" / "PLANS.md").read_text(), (
        "bench/PLANS.md is stale: regenerate it with `mppo plan " + " ".join(recipes)
        + " --hf-config auto --markdown --out bench/PLANS.md`")


if __name__ == "__main__" and sys.argv[1:] == ["MEASURE"]:
    _measure()


def test_moe_experts_per_ep_rank_and_all_to_all_bytes_by_hand():
    """Qwen3-30B-A3B at TP1 PP1 DP8 EP8: each rank holds 16 of the 128 experts of all 48 layers; the experts'
    Adam state is divided over expert-DP 1, the rest over DP 8; all-to-all sent per rank per step counted by hand.
    EP that does not divide the experts or DP, or EP on a dense model, is a PlanError naming the key."""
    from mppo.config import load_config
    from mppo.models.hf_config import read_hf_config
    from mppo.plan import known_config, plan
    from mppo.plan.memory import PlanError, Precision, model_state

    a = read_hf_config(known_config("Qwen3-30B-A3B")[1])
    h, f, layers = 2048, 768, 48
    expert = 3 * h * f
    assert a.moe_layers == tuple(range(layers))
    attention = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h
    per_layer = attention + 16 * expert + 2 * h + 2 * 128 + 128 * h  # + norms, q/k norms, router
    lay = dataclasses.replace(_layout(dp=8, distributed=True), ep=8)
    state = model_state(a, lay, Precision.for_dtype(2, True), stage=0)
    emb = 151936 * h
    assert state.params == layers * per_layer + 2 * emb + h
    experts = layers * 16 * expert
    assert state.optimizer == math.ceil((state.params - experts) * 12 / 8) + experts * 12

    overrides = ["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
                 "data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=1024",
                 "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false",
                 "actor_rollout_ref.actor.reuse_on_policy_log_prob=false"]
    p = plan(load_config(None, overrides), a)
    tokens = 64 * 8 * 2048 / 8
    passes = 2 + 1 + 1  # update forward + backward, old log-probs, reference
    assert (p.moe.ep, p.moe.experts_per_rank, p.moe.expert_params_per_rank) == (8, 16, experts)
    assert p.moe.all_to_all_bytes_per_step == passes * layers * 2 * tokens * 8 * h * 2 * 7 / 8
    assert p.roles[0].layout.ep == 8
    bad = load_config(None, overrides)
    bad.actor_rollout_ref.actor.megatron.expert_model_parallel_size = 3  # past the config validation
    with pytest.raises(PlanError, match="EP = 3 does not divide DP = 8"):
        plan(bad, a)
    with pytest.raises(PlanError, match="EP=8 needs a MoE model"):
        plan(load_config(None, overrides), read_hf_config(known_config("Qwen3-0.6B")[1]))
