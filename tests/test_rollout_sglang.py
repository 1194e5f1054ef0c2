"""The SGLang engine's logic against fakes shaped like SGLang 0.5.23's API (no sglang on this machine).

What the fakes cannot show (real CUDA IPC, SGLang's own loading and sampling) is listed in the rollout report.
This file is also a torchrun script: the 2-rank case (a rollout-TP group of two) runs it under gloo.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import importlib.metadata
import itertools
import json
import pickle
import random
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mppo.rollout import RolloutStateError, SamplingParams, sample_seed
from mppo.rollout import sglang_protocol
from mppo.rollout.sglang_engine import SGLangRolloutEngine
from mppo.rollout.sglang_protocol import (
    SGLangAPI,
    SGLangError,
    build_generate_request,
    check_sglang_version,
    engine_server_args,
    load_sglang_api,
    parse_generate_output,
)


# ---- fakes (the shapes of SGLang 0.5.23's objects; our own implementation) ------------------------------------
@dataclasses.dataclass
class FakeMeta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FakeBucket:
    """Like sglang's FlattenedTensorBucket: tensors of any dtypes as one flat uint8 buffer plus metadata."""

    supports_multi_dtypes = True

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is None:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata
            return
        parts, self.metadata, offset = [], [], 0
        for name, tensor in named_tensors:
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self.metadata.append(FakeMeta(name, tensor.shape, tensor.dtype, offset, offset + raw.numel(), raw.numel()))
            parts.append(raw)
            offset += raw.numel()
        self.flattened_tensor = torch.cat(parts)

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]


class InProcessIPC:
    """Stands in for CUDA IPC in one process: a handle names the producer's buffer, held only WEAKLY, so a
    producer that drops its bucket before SGLang copied it makes the copy fail, as freed IPC memory would."""

    def __init__(self):
        self._live = {}
        self._ids = itertools.count()

    def serialize(self, obj, output_str=False):
        assert output_str, "the engine must send base64 strings, as SGLang's flattened_bucket path expects"
        handle = f"ipc-{next(self._ids)}"
        self._live[handle] = (weakref.ref(obj["flattened_tensor"]), obj["metadata"])
        return handle

    def open(self, handle):
        ref, metadata = self._live.pop(handle)
        tensor = ref()
        assert tensor is not None, "the producer freed its bucket before SGLang copied it"
        return {"flattened_tensor": tensor, "metadata": metadata}


class PickleSerializer:
    """Cross-process stand-in (the 2-rank test): a copy, not shared memory."""

    @staticmethod
    def serialize(obj, output_str=False):
        assert output_str
        return base64.b64encode(pickle.dumps(obj)).decode()

    @staticmethod
    def open(payload):
        return pickle.loads(base64.b64decode(payload))


def fake_tokens(seed: int, max_new_tokens: int, stop_ids: list[int]) -> tuple[list[int], list[float], dict]:
    """What the fake engine 'samples' for a request: a pure function of its sampling_seed."""
    rng = random.Random(seed)
    tokens, log_probs = [], []
    for _ in range(max_new_tokens):
        tokens.append(rng.randrange(50))
        log_probs.append(-rng.random())
        if tokens[-1] in stop_ids:
            return tokens, log_probs, {"type": "stop", "matched": tokens[-1]}
    return tokens, log_probs, {"type": "length", "length": max_new_tokens}


class FakeSGLangEngine:
    """Follows sglang.Engine 0.5.23: weight updates only inside begin/end sessions, (success, message) results."""

    def __init__(self, ipc, fail_update_number=None, **server_args):
        self.server_args, self.ipc, self.fail_update_number = server_args, ipc, fail_update_number
        self.calls, self.weights, self.released, self.session, self.updates = [], {}, set(), False, 0

    def begin_weight_update(self, selector="all"):
        self.calls.append("begin")
        if self.session:
            return False, "begin_weight_update called while a weight-update session is already open"
        self.session = True
        return True, "ok"

    def end_weight_update(self):
        self.calls.append("end")
        ok, self.session = self.session, False
        return ok, "ok" if ok else "no session"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", len(named_tensors), load_format, flush_cache))
        self.updates += 1
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if "weights" in self.released:
            return False, "weights are released"
        if self.updates == self.fail_update_number:
            return False, "injected failure"
        per_rank = []  # each engine TP rank opens its own payload
        for payload in named_tensors:
            data = self.ipc.open(payload)
            bucket = FakeBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
            per_rank.append(dict(bucket.reconstruct_tensors()))
        for other in per_rank[1:]:
            assert other.keys() == per_rank[0].keys() and all(torch.equal(other[n], t) for n, t in per_rank[0].items())
        self.weights.update({name: tensor.clone() for name, tensor in per_rank[0].items()})
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")
        return SimpleNamespace(success=True, message="")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))
        self.released |= set(tags)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))
        self.released -= set(tags)

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, lora_path=None):
        assert return_logprob and not self.released and not self.session
        self.calls.append(("generate", len(input_ids)) if lora_path is None else ("generate", len(input_ids),
                                                                                  lora_path[0]))
        outputs = []
        for ids, params in zip(input_ids, sampling_params, strict=True):
            assert params["n"] == 1
            tokens, log_probs, finish = fake_tokens(params["sampling_seed"], params["max_new_tokens"], params["stop_token_ids"])
            outputs.append({
                "output_ids": tokens,
                "meta_info": {"finish_reason": finish, "output_token_logprobs": [(lp, t, None) for lp, t in zip(log_probs, tokens)]},
            })
        return outputs

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        self.calls.append(("load_lora", lora_name))
        ok = lora_name not in self.server_args.get("fail_lora", ())
        return SimpleNamespace(success=ok, error_message="" if ok else "injected failure")

    def unload_lora_adapter(self, lora_name):
        self.calls.append(("unload_lora", lora_name))
        return SimpleNamespace(success=True, error_message="")

    def shutdown(self):
        self.calls.append("shutdown")


def fake_api(serializer, **engine_options) -> tuple[SGLangAPI, list]:
    engines = []

    def make_engine(**server_args):
        engines.append(FakeSGLangEngine(serializer, **engine_options, **server_args))
        return engines[-1]

    return SGLangAPI(make_engine, FakeBucket, serializer, lambda: None), engines


def weight_stream(bucket_size=3):
    """An HF-named stream with mixed dtypes, in buckets."""
    torch.manual_seed(0)
    named = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(4, 3)) for i in range(5)]
    named += [("model.norm.weight", torch.randn(3).to(torch.bfloat16)), ("model.embed_tokens.weight", torch.randn(7, 3))]
    return named, [named[i : i + bucket_size] for i in range(0, len(named), bucket_size)]


SAMPLING = SamplingParams(n=2, temperature=0.9, top_p=0.95, top_k=20, max_new_tokens=6, stop_token_ids=[3], seed=42)


# ---- single-process tests ---------------------------------------------------------------------------------------
def test_version_range_and_missing_package(monkeypatch):
    for ok in ("0.5.23", "0.5.23.post1", "0.5.40"):
        check_sglang_version(ok)
    for bad in ("0.5.22", "0.4.9", "0.6.0", "1.0"):
        with pytest.raises(ImportError, match=r"sglang>=0\.5\.23,<0\.6.*pip install 'mppo\[gpu\]'"):
            check_sglang_version(bad)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sglang_protocol.importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"not installed.*pip install 'mppo\[gpu\]'"):
        load_sglang_api()
    monkeypatch.setattr(sglang_protocol.importlib.metadata, "version", lambda name: "0.5.1")
    with pytest.raises(ImportError, match="found sglang 0.5.1"):
        load_sglang_api()


def test_server_args():
    args = engine_server_args("/ckpt", tp_size=2, gpu_memory_utilization=0.6, dtype="bfloat16", base_gpu_id=4, seed=1,
                              extra={"attention_backend": "torch_native"})
    assert args["mem_fraction_static"] == 0.6 and args["tp_size"] == 2 and args["base_gpu_id"] == 4
    assert args["load_format"] == "dummy" and args["skip_tokenizer_init"] and args["enable_memory_saver"]
    assert args["enable_deterministic_inference"] and args["attention_backend"] == "torch_native"
    assert args["sleep_on_idle"]  # its effect on a real engine: tests/test_rollout_sglang_cpu.py
    assert not engine_server_args("/ckpt", tp_size=1, gpu_memory_utilization=0.6, dtype="bf16", base_gpu_id=0,
                                  seed=0, extra={"sleep_on_idle": False})["sleep_on_idle"]
    with pytest.raises(ValueError, match="fixed"):
        engine_server_args("/ckpt", tp_size=1, gpu_memory_utilization=0.6, dtype="bf16", base_gpu_id=0, seed=0,
                           extra={"enable_deterministic_inference": False})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_server_args("/ckpt", tp_size=1, gpu_memory_utilization=1.5, dtype="bf16", base_gpu_id=0, seed=0)


def test_requests_carry_per_sample_seeds_of_global_prompt_indices():
    input_ids, params, keys = build_generate_request([[5, 6], [7]], SAMPLING, step=9, prompt_indices=[10, 3])
    assert input_ids == [[5, 6], [5, 6], [7], [7]]
    assert keys == [(10, 0), (10, 1), (3, 0), (3, 1)]
    assert [p["sampling_seed"] for p in params] == [sample_seed(42, 9, g, s) for g, s in keys]
    assert all(p["n"] == 1 and p["top_k"] == 20 and p["top_p"] == 0.95 and p["temperature"] == 0.9 for p in params)
    assert params[0]["stop_token_ids"] == [3] and params[0]["max_new_tokens"] == 6
    assert params[0]["ignore_eos"] is False
    _, fixed, _ = build_generate_request([[1]], SamplingParams(stop_token_ids=[3], ignore_eos=True), 0, [0])
    assert fixed[0]["ignore_eos"] is True and fixed[0]["stop_token_ids"] == [3]  # SGLang skips both when set
    _, greedy, _ = build_generate_request([[1]], SamplingParams(do_sample=False, temperature=0.7), 0, [0])
    assert greedy[0]["temperature"] == 0.0 and greedy[0]["top_k"] == -1 and greedy[0]["top_p"] == 1.0


def test_response_parsing_and_its_errors():
    outputs = [{"output_ids": [4, 3], "meta_info": {"finish_reason": {"type": "stop", "matched": 3},
                                                   "output_token_logprobs": [(-0.5, 4, None), (-1.5, 3, None)]}}]
    (r,) = parse_generate_output(outputs, [(7, 1)])
    assert (r.prompt_index, r.sample_index, r.token_ids, r.log_probs, r.finish_reason) == (7, 1, [4, 3], [-0.5, -1.5], "stop")
    aborted = [{"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "oom"},
                                               "output_token_logprobs": []}}]
    with pytest.raises(SGLangError, match="oom"):
        parse_generate_output(aborted, [(0, 0)])
    mismatched = [{"output_ids": [4], "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [(-1.0, 5, None)]}}]
    with pytest.raises(SGLangError, match="do not match"):
        parse_generate_output(mismatched, [(0, 0)])
    with pytest.raises(SGLangError, match="2 requests"):
        parse_generate_output(outputs, [(0, 0), (0, 1)])


def test_routed_experts_keep_the_moe_layers_of_every_token_but_the_last(tmp_path):
    """SGLang's routes (base64 int32 [prompt + output - 1, all hidden layers, k], encoded as its detokenizer does)
    become RolloutResponse.routed_experts of the MoE layers only; the layout comes from the model's config.json."""
    import base64
    import json

    import numpy as np

    from mppo.rollout.sglang_protocol import RouteLayout

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "mlp_only_layers": [1]}))
    layout = RouteLayout.of_model(str(model))
    assert layout == RouteLayout(num_layers=4, moe_layers=(0, 2, 3), top_k=2)
    prompt, output = [9, 8, 7], [4, 3]
    every_layer = np.random.default_rng(0).integers(0, 8, size=(len(prompt) + len(output) - 1, 4, 2), dtype=np.int32)
    every_layer[:, 1] = 0  # SGLang never writes a dense layer's rows
    outputs = [{"output_ids": output, "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [(-0.5, 4, None), (-1.5, 3, None)],
        "routed_experts": base64.b64encode(every_layer.tobytes()).decode("utf-8")}}]
    (r,) = parse_generate_output(outputs, [(0, 0)], routes=layout, prompt_lengths=[len(prompt)])
    assert r.routed_experts.dtype == torch.int32
    assert r.routed_experts.tolist() == every_layer[:, [0, 2, 3]].tolist()
    with pytest.raises(SGLangError, match="expected 3 tokens x 4 layers x top-2"):  # a prompt length off by one
        parse_generate_output(outputs, [(0, 0)], routes=layout, prompt_lengths=[2])
    del outputs[0]["meta_info"]["routed_experts"]
    with pytest.raises(SGLangError, match="enable_return_routed_experts"):
        parse_generate_output(outputs, [(0, 0)], routes=layout, prompt_lengths=[3])
    args = engine_server_args(str(model), tp_size=1, gpu_memory_utilization=0.5, dtype="float32", base_gpu_id=0,
                              seed=0, return_routed_experts=True)
    assert args["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine_server_args(
        str(model), tp_size=1, gpu_memory_utilization=0.5, dtype="float32", base_gpu_id=0, seed=0)
    dense = tmp_path / "dense"
    dense.mkdir()
    config = json.loads((model / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    with pytest.raises(SGLangError, match="no MoE layer"):
        RouteLayout.of_model(str(dense))


def test_a_qwen3_moe_with_dense_layers_is_refused_for_sglang(tmp_path):
    """SGLang 0.5.23's Qwen3-MoE builds every layer as MoE (pinned in tests/test_rollout_sglang_cpu.py) and does not
    tie its head: such models stop at start-up in one line; an untied all-MoE one passes."""
    import json

    from mppo.config import ConfigError
    from mppo.preflight import check_sglang_serves

    config = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "max_position_embeddings": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    for name, extra in (("all_moe", {}), ("dense_layer", {"mlp_only_layers": [1]}),
                        ("sparse_step", {"decoder_sparse_step": 2}), ("tied", {"tie_word_embeddings": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    check_sglang_serves(str(tmp_path / "all_moe"))
    check_sglang_serves(None)
    with pytest.raises(ConfigError, match=r"has dense layers \[1\] .* use actor_rollout_ref.rollout.name=cpu"):
        check_sglang_serves(str(tmp_path / "dense_layer"))
    with pytest.raises(ConfigError, match=r"has dense layers \[0, 2\]"):
        check_sglang_serves(str(tmp_path / "sparse_step"))
    with pytest.raises(ConfigError, match="ties its head to the embedding"):
        check_sglang_serves(str(tmp_path / "tied"))


def test_weight_sync_session_buckets_and_bitwise_weights():
    ipc = InProcessIPC()
    api, engines = fake_api(ipc)
    engine = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, api=api)
    (fake,) = engines
    assert fake.server_args["mem_fraction_static"] == 0.5 and fake.server_args["tp_size"] == 1
    named, buckets = weight_stream()
    with pytest.raises(RolloutStateError):
        engine.generate([[1]], SAMPLING, step=0)
    engine.update_weights(buckets)
    assert fake.calls == ["begin"] + [("update", 1, "flattened_bucket", False)] * len(buckets) + ["end", "flush"]
    for name, tensor in named:
        got = fake.weights[name]
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
    assert not ipc._live, "every bucket handed to SGLang was consumed"


def test_buckets_are_not_hoarded_and_exporter_buffers_may_be_reused():
    ipc = InProcessIPC()
    api, engines = fake_api(ipc)
    engine = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, api=api)
    refs = []
    real_serialize = ipc.serialize

    def tracking_serialize(obj, output_str=False):
        refs.append(weakref.ref(obj["flattened_tensor"]))
        return real_serialize(obj, output_str)

    ipc.serialize = tracking_serialize
    reused = torch.zeros(4, 3)  # an exporter that refills ONE buffer for every bucket

    def exporter():
        for i in range(3):
            reused.fill_(float(i))
            yield [(f"model.layers.{i}.mlp.up_proj.weight", reused)]

    engine.update_weights(exporter())
    assert [engines[0].weights[f"model.layers.{i}.mlp.up_proj.weight"][0, 0].item() for i in range(3)] == [0.0, 1.0, 2.0]
    assert all(r() is None for r in refs), "flattened buckets are freed once SGLang's call returned"


def test_memory_dance_order_and_generation():
    api, engines = fake_api(InProcessIPC())
    engine = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, api=api)
    fake = engines[0]
    _, buckets = weight_stream()
    engine.update_weights(buckets)
    first = engine.generate([[1, 2], [3]], SAMPLING, step=5, prompt_offsets=[8, 2])
    for r in first:
        tokens, log_probs, finish = fake_tokens(sample_seed(42, 5, r.prompt_index, r.sample_index), 6, [3])
        assert (r.token_ids, r.log_probs, r.finish_reason) == (tokens, log_probs, finish["type"])
    assert [(r.prompt_index, r.sample_index) for r in first] == [(8, 0), (8, 1), (2, 0), (2, 1)]

    fake.calls.clear()
    engine.release()
    with pytest.raises(RolloutStateError, match="update_weights"):
        engine.resume()
    engine.update_weights(buckets)
    engine.resume()
    engine.flush_cache()
    again = engine.generate([[1, 2], [3]], SAMPLING, step=5, prompt_offsets=[8, 2])
    assert fake.calls == (
        ["flush", ("release", ("kv_cache", "weights", "cuda_graph")), ("resume", ("weights",)), "begin"]
        + [("update", 1, "flattened_bucket", False)] * len(buckets)
        + ["end", "flush", ("resume", ("kv_cache", "cuda_graph")), "flush", ("generate", 4)]
    )
    assert again == first
    engine.shutdown()
    assert fake.calls[-1] == "shutdown"


def test_adapter_only_engine_keeps_the_base_and_serves_only_with_an_adapter():
    """lora= (lora.merge=false): the server args ask SGLang for LoRA support, a release frees the KV cache only
    (once, however often it is called) and keeps the base, each adapter replaces the previous one, every request
    names it, and an engine without an adapter (none yet, or the last load failed) refuses to generate."""
    api, engines = fake_api(InProcessIPC())
    engine = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, api=api,
                                 lora={"rank": 8, "target_modules": ["q_proj", "v_proj"]},
                                 server_args={"fail_lora": ["mppo-adapter-2"]})
    fake = engines[0]
    assert {k: fake.server_args[k] for k in ("enable_lora", "max_lora_rank", "lora_target_modules",
                                             "max_loras_per_batch")} == {
        "enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"], "max_loras_per_batch": 1}
    assert "lora_backend" not in fake.server_args  # SGLang's own choice on GPUs; torch_native on the CPU tier
    _, buckets = weight_stream()
    with pytest.raises(RolloutStateError, match="update_weights"):
        engine.update_adapter({}, {})
    engine.update_weights(buckets)
    with pytest.raises(RolloutStateError, match="holds no adapter"):
        engine.generate([[1, 2]], SAMPLING, step=0)
    engine.update_adapter({}, {"r": 8})
    fake.calls.clear()
    engine.generate([[1, 2]], SAMPLING, step=0)
    engine.release()
    engine.release()
    assert engine.weights_loaded
    engine.update_adapter({}, {"r": 8})
    engine.resume()
    engine.generate([[1, 2]], SAMPLING, step=0)
    assert fake.calls == [("generate", 2, "mppo-adapter-0"), "flush", ("release", ("kv_cache", "cuda_graph")),
                          ("unload_lora", "mppo-adapter-0"), ("load_lora", "mppo-adapter-1"), "flush",
                          ("resume", ("kv_cache", "cuda_graph")), ("generate", 2, "mppo-adapter-1")]
    with pytest.raises(SGLangError, match="injected failure"):
        engine.update_adapter({}, {"r": 8})
    with pytest.raises(RolloutStateError, match="the last load failed"):
        engine.generate([[1, 2]], SAMPLING, step=0)


def test_dp_split_sends_the_same_seeds_as_one_engine():
    _, buckets = weight_stream()
    prompts = [[i, i + 1] for i in range(6)]

    def engine():
        api, _ = fake_api(InProcessIPC())
        e = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, api=api)
        e.update_weights(buckets)
        return e

    whole = engine().generate(prompts, SAMPLING, step=3)
    split = engine().generate(prompts[:3], SAMPLING, step=3) + engine().generate(
        prompts[3:], SAMPLING, step=3, prompt_offsets=[3, 4, 5])
    assert split == whole


def test_a_failed_bucket_raises_and_closes_the_session():
    api, engines = fake_api(InProcessIPC(), fail_update_number=2)
    engine = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, api=api)
    _, buckets = weight_stream()
    with pytest.raises(SGLangError, match="update_weights_from_tensor failed: injected failure"):
        engine.update_weights(buckets)
    assert engines[0].calls[-1] == "end" and not engines[0].session
    with pytest.raises(RolloutStateError):
        engine.generate([[1]], SAMPLING, step=0)
    engine.update_weights(buckets)  # the next update opens a fresh session
    engine.generate([[1]], SAMPLING, step=0)


# ---- two ranks: one rollout-TP group of 2 (gloo) -----------------------------------------------------------------
def test_two_rank_group_gathers_payloads_and_shares_results(tmp_path):
    from dist_util import run_torchrun

    ranks = run_torchrun(Path(__file__), 2, tmp_path, timeout=300)
    for rank, result in enumerate(ranks):
        assert result["failures"] == [], (rank, result["failures"])
        assert result["generate_matches_driver"] is True
        assert result["mismatch_error"] and "identical weight buckets" in result["mismatch_error"]
        assert result["rank_error"] and "exporter broke" in result["rank_error"]
    driver = ranks[0]
    assert driver["payloads_per_update"] == [2], "one payload per engine TP rank"
    assert driver["weights_bitwise"] is True
    assert driver["memory_calls"] == [["release", ["kv_cache", "weights", "cuda_graph"]], ["resume", ["weights"]]]


def _group_main(out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    api, engines = fake_api(PickleSerializer())
    engine = SGLangRolloutEngine("/ckpt", gpu_memory_utilization=0.5, tp_group=dist.new_group([0, 1]), api=api)
    named, buckets = weight_stream()
    result = {"failures": []}
    assert (len(engines) == 1) == (rank == 0), "only the driver starts an engine"

    engine.update_weights(buckets)
    responses = engine.generate([[1, 2], [3]], SAMPLING, step=1, prompt_offsets=[4, 5])
    gathered = [None, None]
    dist.all_gather_object(gathered, [dataclasses.asdict(r) for r in responses])
    result["generate_matches_driver"] = gathered[0] == gathered[1] and len(gathered[0]) == 4

    extra = [buckets[0]] if rank == 1 else []  # rank 1 streams one bucket more
    try:
        engine.update_weights(buckets + extra)
        result["failures"].append("mismatched buckets were accepted")
    except SGLangError as exc:
        result["mismatch_error"] = str(exc)

    def broken():
        yield buckets[0]
        if rank == 1:
            raise RuntimeError("exporter broke")
        yield buckets[1]

    try:
        engine.update_weights(broken())
        result["failures"].append("a failing rank went unnoticed")
    except (SGLangError, RuntimeError) as exc:
        result["rank_error"] = str(exc)

    engine.update_weights(buckets)
    if rank == 0:
        fake = engines[0]
        updates = [c for c in fake.calls if isinstance(c, tuple) and c[0] == "update"]
        result["payloads_per_update"] = sorted({c[1] for c in updates})
        result["weights_bitwise"] = all(
            torch.equal(fake.weights[n].view(torch.uint8), t.view(torch.uint8)) for n, t in named
        )
        fake.calls.clear()
    engine.release()
    engine.update_weights(buckets)
    if rank == 0:
        result["memory_calls"] = [list(c[:1]) + [list(c[1])] for c in engines[0].calls if c[0] in ("release", "resume")]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    _group_main(parser.parse_args().out)


def test_engine_start_keeps_the_trainers_logging_and_sends_sglangs_to_its_log(tmp_path):
    """SGLang 0.5.23's Engine runs configure_logger in the trainer's process: basicConfig(force=True) at its
    log_level. After start_engine the root logger has the trainer's handler and level again, and SGLang's loggers
    of this process write to the engine's log file, not the console (the real engine: tests/test_trainer_sglang.py)."""
    import logging

    from mppo.rollout.sglang_startup import start_engine

    class ConfiguresLogging:  # what sglang.srt.utils.common.configure_logger does, then a log line of its own
        def __init__(self, **server_args):
            logging.basicConfig(level=server_args["log_level"].upper(), format="[sglang] %(message)s", force=True)
            logging.getLogger("sglang.srt.managers.tokenizer_manager").error("sglang's own line")

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    root, console = logging.getLogger(), Keep()
    saved = list(root.handlers), root.level
    root.handlers[:] = [console]
    root.setLevel(logging.INFO)
    try:
        log = tmp_path / "rollout" / "sglang_group0.log"
        start_engine(ConfiguresLogging, {"log_level": "error"}, log_path=log, what="group 0", on_cpu=False)
        logging.getLogger("mppo").info("rollout: 1 sglang engine(s)")
        logging.getLogger("sglang.srt.entrypoints.engine").error("sglang after the start")
        assert root.handlers == [console] and root.level == logging.INFO
        assert console.lines == ["rollout: 1 sglang engine(s)"]
        assert "sglang after the start" in log.read_text()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        sglang = logging.getLogger("sglang")
        for handler in list(sglang.handlers):
            sglang.removeHandler(handler)
            handler.close()
        sglang.propagate, sglang.level = True, logging.NOTSET
