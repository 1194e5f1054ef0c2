"""A lone process (world of one, gloo): mppo's SDPA core attention against a naive attention written out here and
against megatron-core's DotProductAttention, and the SDPA spec's GPTModel against the local spec's.

Run as a plain `python` subprocess by tests/test_models_attention.py; prints one JSON line {case: value}.
"""
from __future__ import annotations

import json
import math

import torch

SQ, B, HEADS, GROUPS, HEAD_DIM = 37, 2, 4, 2, 16


def naive_attention(q, k, v, keep):
    """softmax(q k^T / sqrt(d) where keep, else -inf) v with K/V repeated per query group; [s, b, h, d] in,
    [s, b, h * d] out. Rows with no key to keep attend uniformly to every key (megatron's finite fill)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = ~keep.any(dim=-1, keepdim=True)
    scores = torch.where(empty.expand_as(scores), torch.zeros_like(scores), scores)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v.double())
    return out.reshape(q.shape[0], q.shape[1], -1)


def qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SQ, B, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(SQ, B, GROUPS, HEAD_DIM, generator=g)
    v = torch.randn(SQ, B, GROUPS, HEAD_DIM, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def grads_of(fn, tensors, upstream):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    (out.double() * upstream).sum().backward()
    return out.detach().double(), [t.grad.double().clone() for t in tensors]


def max_rel(got, ref):
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))


def core_attention_cases(res: dict, config) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mppo.models.attention import SDPAttention

    causal = AttnMaskType.causal
    sdpa = SDPAttention(config, layer_number=1, attn_mask_type=causal, attention_type="self")
    local = DotProductAttention(config, layer_number=1, attn_mask_type=causal, attention_type="self")
    upstream = torch.randn(SQ, B, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tensors = qkv()
    tril = torch.ones(SQ, SQ, dtype=torch.bool).tril()

    # no mask, causal layer: what mppo passes (right-padded rows, positions 0..s-1)
    ref, ref_grads = grads_of(lambda q, k, v: naive_attention(q, k, v, tril), tensors, upstream)
    out, out_grads = grads_of(lambda q, k, v: sdpa(q, k, v, None), tensors, upstream)
    res["causal/sdpa_vs_naive"] = max_rel([out], [ref])
    res["causal/sdpa_grads_vs_naive"] = max_rel(out_grads, ref_grads)
    res["causal/shape"] = list(out.shape)
    loc, loc_grads = grads_of(lambda q, k, v: local(q, k, v, None), tensors, upstream)
    res["causal/local_vs_naive"] = max_rel([loc], [ref])
    res["causal/local_grads_vs_naive"] = max_rel(loc_grads, ref_grads)

    # a padding mask [b, 1, 1, sk] (True = masked): row 1's first 5 keys are padding, so its first 5 queries
    # have no key left under the causal mask
    pad = torch.zeros(B, 1, 1, SQ, dtype=torch.bool)
    pad[1, ..., :5] = True
    keep = ~pad & tril
    ref, ref_grads = grads_of(lambda q, k, v: naive_attention(q, k, v, keep), tensors, upstream)
    out, out_grads = grads_of(lambda q, k, v: sdpa(q, k, v, pad), tensors, upstream)
    res["padding/sdpa_vs_naive"] = max_rel([out], [ref])
    res["padding/sdpa_grads_vs_naive"] = max_rel(out_grads, ref_grads)
    res["padding/finite"] = bool(torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in out_grads))
    # megatron's torch softmax path applies a given mask as is (no causal mask added): give it the full mask
    loc, loc_grads = grads_of(lambda q, k, v: local(q, k, v, ~keep), tensors, upstream)
    res["padding/local_vs_naive"] = max_rel([loc], [ref])
    res["padding/local_grads_vs_naive"] = max_rel(loc_grads, ref_grads)
    # a padding-type layer with no causal mask: only the given mask applies
    non_causal = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="self")
    ref = naive_attention(*tensors, ~pad.expand(B, 1, SQ, SQ))
    res["padding_type/sdpa_vs_naive"] = max_rel([non_causal(*tensors, pad).double()], [ref])

    # bf16 inputs: within bf16 rounding of the fp32 result
    low = [t.detach().to(torch.bfloat16) for t in tensors]
    res["bf16/sdpa_vs_naive"] = max_rel([sdpa(*low, None).double()], [naive_attention(*low, tril)])
    res["bf16/dtype"] = str(sdpa(*low, None).dtype)

    # one query against a cache of keys (no causal mask needed); more queries than 1 but fewer than keys: error
    q1 = tensors[0][-1:].detach()
    ref = naive_attention(q1, *tensors[1:], torch.ones(1, SQ, dtype=torch.bool))
    res["decode/sdpa_vs_naive"] = max_rel([sdpa(q1, *tensors[1:], None).double()], [ref])
    # the kernel SDPA runs on CPU for what SDPAttention passes ([b, h, s, d] views, grouped K/V): the flash kernel,
    # with the K/V tensors as they are (kv_for_fused_kernel repeats them only on CUDA, when that avoids math)
    from mppo.models.attention import kv_for_fused_kernel, sdpa_backend

    q, k, v = (t.detach().permute(1, 2, 0, 3) for t in tensors)
    for case, mask, causal in (("causal", None, True), ("masked", keep, False)):
        res[f"dispatch/{case}"] = sdpa_backend(q, k, v, mask, 0.0, causal).name
        kv = kv_for_fused_kernel(q, k, v, mask, 0.0, causal)
        res[f"dispatch/{case}/kv_unchanged"] = kv[0] is k and kv[1] is v
    # context parallelism's local query chunk: queries at natural positions start.. against keys 0..s-1, each
    # seeing the keys up to its own position (lower-right causal): on CPU two flash calls merged by log-sum-exp
    start, rows = 20, 12
    keep_chunk = torch.arange(SQ)[None, :] <= torch.arange(start, start + rows)[:, None]
    chunk_up = upstream[start:start + rows]
    ref, ref_grads = grads_of(lambda q, k, v: naive_attention(q[start:start + rows], k[:start + rows],
                                                              v[:start + rows], keep_chunk[:, :start + rows]),
                              tensors, chunk_up)

    def chunk(q, k, v):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q[start:start + rows], k, v))
        out = sdpa._causal_chunk(q, k, v, start, 0.0)
        return out.permute(2, 0, 1, 3).reshape(rows, B, HEADS * HEAD_DIM)

    out, out_grads = grads_of(chunk, tensors, chunk_up)
    res["cp_chunk/split_vs_naive"] = max_rel([out], [ref])
    res["cp_chunk/split_grads_vs_naive"] = max_rel(out_grads, ref_grads)
    try:
        chunk_with_dropout = sdpa._causal_chunk(*(t.permute(1, 2, 0, 3) for t in tensors), start, 0.1)
        res["cp_chunk/dropout"] = f"no error: {tuple(chunk_with_dropout.shape)}"
    except NotImplementedError as err:
        res["cp_chunk/dropout"] = str(err)
    for key, call in {
        "errors/uneven_causal": lambda: sdpa(tensors[0][:5], *tensors[1:], None),
        "errors/packed": lambda: sdpa(*tensors, None, packed_seq_params=PackedSeqParams(qkv_format="thd")),
        "errors/bias": lambda: sdpa(*tensors, None, attention_bias=torch.zeros(1)),
    }.items():
        try:
            call()
            res[key] = "no error"
        except (ValueError, NotImplementedError) as err:
            res[key] = f"{type(err).__name__}: {err}"


def model_cases(res: dict, args, dims) -> None:
    """GPTModel with the SDPA spec vs the local spec, same weights: logits and every parameter gradient."""
    from mppo.models.builders import build_gpt_model

    torch.manual_seed(0)
    local = build_gpt_model(args, dims, transformer_impl="local")[0]
    sdpa = build_gpt_model(args, dims, transformer_impl="sdpa")[0]
    auto = build_gpt_model(args, dims, transformer_impl="auto")[0]
    res["model/core_attention"] = {name: type(m.decoder.layers[0].self_attention.core_attention).__name__
                                   for name, m in (("local", local), ("sdpa", sdpa), ("auto", auto))}
    res["model/state_dict_keys_equal"] = sorted(local.state_dict()) == sorted(sdpa.state_dict())
    res["model/sharded_keys_equal"] = sorted(local.sharded_state_dict()) == sorted(sdpa.sharded_state_dict())
    sdpa.load_state_dict(local.state_dict())
    ids = torch.randint(0, args.vocab_size, (3, 29), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    upstream = torch.randn(3, 29, local.vocab_size, generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (local, sdpa):
        logits = model(ids, pos, None)
        (logits * upstream).sum().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    res["model/logits_sdpa_vs_local"] = (outs[0][0] - outs[1][0]).abs().max().item()
    res["model/grads_sdpa_vs_local_rel"] = max(
        ((outs[1][1][n] - g).abs().max() / g.abs().max()).item() for n, g in outs[0][1].items())


def main() -> None:
    from mppo.models.builders import build_transformer_config
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed

    res: dict = {}
    dims = init_distributed(1, 1, seed=3)
    args = read_hf_config({"model_type": "qwen2", "hidden_size": HEADS * HEAD_DIM, "intermediate_size": 96,
                           "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": GROUPS,
                           "vocab_size": 300})
    config = build_transformer_config(args, dims)
    core_attention_cases(res, config)
    window = build_transformer_config(args, dims, window_size=(8, 0))
    try:
        from mppo.models.attention import SDPAttention
        from megatron.core.transformer.enums import AttnMaskType

        SDPAttention(window, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        res["errors/window"] = "no error"
    except NotImplementedError as err:
        res["errors/window"] = f"NotImplementedError: {err}"
    model_cases(res, args, dims)
    destroy(process_group=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
