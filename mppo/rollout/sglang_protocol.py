"""The SGLang side of rollout, as plain functions: version check, lazy import, engine arguments, generate requests,
response parsing and weight-bucket payloads. Kept apart from the engine class so that all of it is testable
without sglang (tests pass fakes shaped like SGLang 0.5.23's API).

SGLang API used (0.5.23, python/sglang/srt/entrypoints/engine.py):
  Engine(**server_args); generate(input_ids=[[...]], sampling_params=[{...}], return_logprob=True) -> list of
  {"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", ...},
  "output_token_logprobs": [(logprob, token_id, None), ...]}} in request order; with return_routed_experts=True
  (server started with enable_return_routed_experts) also meta_info["routed_experts"], a base64 string of int32
  [prompt + output - 1, num_hidden_layers, num_experts_per_tok] (sglang.srt.state_capturer.routed_experts);
  begin_weight_update() / end_weight_update() -> (success, message); update_weights_from_tensor(named_tensors=
  [one serialized payload per engine TP rank], load_format="flattened_bucket", flush_cache=False) ->
  (success, message); flush_cache() -> object with .success; release_memory_occupation(tags) /
  resume_memory_occupation(tags) -> None; shutdown().
"""
from __future__ import annotations

import base64
import dataclasses
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mppo.rollout.base import NamedTensor, RolloutResponse, SamplingParams
from mppo.rollout.seeding import sample_seed, stable_hash63

# 0.5.23 introduced begin/end_weight_update sessions (updates outside one fail) and multi-dtype flattened buckets.
SUPPORTED_SGLANG = ">=0.5.23,<0.6"
INSTALL_HINT = (f"pip install 'mppo[gpu]' (or pip install 'sglang{SUPPORTED_SGLANG}'); on a machine without GPUs "
                "`make sglang` installs SGLang's CPU tier")

# Server arguments the engine's contract depends on; a user override would silently break it.
_FIXED_SERVER_ARGS = {
    "load_format": "dummy",  # weights arrive only through update_weights (no checkpoint read at start-up)
    "skip_tokenizer_init": True,  # we send token ids and read output_ids
    "enable_memory_saver": True,  # needed by release/resume_memory_occupation
    "enable_deterministic_inference": True,  # without it SGLang ignores sampling_seed; also batch-invariant kernels
}
# On the CPU the memory saver and deterministic inference are unavailable; mppo.rollout.sglang_cpu says why and
# what that changes (release frees nothing, sampling_seed is ignored).
RELEASE_TAGS = ["kv_cache", "weights", "cuda_graph"]
RESUME_WEIGHT_TAGS = ["weights"]
RESUME_KV_TAGS = ["kv_cache", "cuda_graph"]


class SGLangError(RuntimeError):
    """SGLang reported a failure (weight update, generation abort, ...)."""


@dataclasses.dataclass(frozen=True)
class RouteLayout:
    """How SGLang's routed experts map to RolloutResponse.routed_experts (routing replay, R3): SGLang records every
    hidden layer (a dense layer's rows are zeros), mppo keeps the MoE layers' rows in layer order."""

    num_layers: int  # num_hidden_layers: SGLang's layer axis
    moe_layers: tuple[int, ...]  # the MoE layers' indices (mppo.models.hf_config.HFModelArgs.moe_layers)
    top_k: int  # num_experts_per_tok

    @classmethod
    def of_model(cls, model_path: str) -> "RouteLayout":
        from mppo.models.hf_config import read_hf_config

        args = read_hf_config(model_path)
        if not args.moe_layers:
            raise SGLangError(f"routed experts requested, but the model at {model_path!r} has no MoE layer")
        return cls(num_layers=args.num_layers, moe_layers=tuple(args.moe_layers), top_k=args.moe_topk)

    def decode(self, encoded: str, tokens: int) -> torch.Tensor:
        """SGLang's base64 routes of one request -> [tokens, MoE layers, top_k] int32."""
        flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
        if flat.numel() != tokens * self.num_layers * self.top_k:
            raise SGLangError(f"SGLang returned {flat.numel()} routed-expert ids, expected {tokens} tokens x "
                              f"{self.num_layers} layers x top-{self.top_k}")
        return flat.view(tokens, self.num_layers, self.top_k)[:, list(self.moe_layers)].clone()


@dataclasses.dataclass(frozen=True)
class SGLangAPI:
    """The SGLang objects the engine uses; `load_sglang_api()` gives the real ones, tests give fakes."""

    engine_cls: Callable[..., Any]  # sglang.Engine
    bucket_cls: type  # sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket
    serializer: Any  # sglang.srt.utils.MultiprocessingSerializer (serialize(obj, output_str=True))
    patch_torch_reductions: Callable[[], None]  # CUDA IPC handles keyed by device UUID, as SGLang expects


def check_sglang_version(version: str) -> None:
    if Version(version) not in SpecifierSet(SUPPORTED_SGLANG):
        raise ImportError(f"mppo's SGLang rollout needs sglang{SUPPORTED_SGLANG}, found sglang {version}: {INSTALL_HINT}")


def sglang_version_here() -> str | None:
    """The version of the SGLang installed here (its package metadata: nothing is imported), None without one."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_sglang_version() -> str:
    """The installed SGLang's version, checked against SUPPORTED_SGLANG (ImportError naming the fix otherwise)."""
    version = sglang_version_here()
    if version is None:
        raise ImportError(f"the SGLang rollout engine needs SGLang, which is not installed: {INSTALL_HINT}")
    check_sglang_version(version)
    return version


def load_sglang_api(*, on_cpu: bool = False) -> SGLangAPI:
    """Import SGLang lazily (it is a GPU-only package) after checking its version. `on_cpu`: SGLang will run on the
    CPU (mppo.rollout.sglang_cpu puts its stand-ins in place first)."""
    version = installed_sglang_version()
    if on_cpu:
        from mppo.rollout import sglang_cpu

        sglang_cpu.activate()
    import sglang
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if not getattr(FlattenedTensorBucket, "supports_multi_dtypes", False):
        raise ImportError(f"sglang {version} cannot carry mixed dtypes in one weight bucket: {INSTALL_HINT}")
    return SGLangAPI(sglang.Engine, FlattenedTensorBucket, MultiprocessingSerializer, monkey_patch_torch_reductions)


def engine_server_args(
    model_path: str,
    *,
    tp_size: int,
    gpu_memory_utilization: float,
    dtype: str,
    base_gpu_id: int,
    seed: int,
    extra: dict[str, Any] | None = None,
    on_cpu: bool = False,
    max_total_tokens: int | None = None,
    return_routed_experts: bool = False,
    trust_remote_code: bool = False,
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for sglang.Engine. `model_path` is an HF directory; only its config is read (with the
    checkpoint's own config code under `trust_remote_code`: actor_rollout_ref.model.trust_remote_code).

    `on_cpu`: SGLang's CPU tier (mppo.rollout.sglang_cpu.CPU_SERVER_ARGS replace the memory saver and deterministic
    inference). `max_total_tokens` caps the KV pool (on the CPU the pool is host memory; None: SGLang sizes it from
    `gpu_memory_utilization`). `return_routed_experts`: the engine records the experts every MoE layer chose
    (routing replay, R3). `lora` ({"rank", "target_modules"}): SGLang's LoRA support for adapter-only weight sync,
    one adapter at a time (on the CPU its torch-native backend, the only one without a GPU kernel).
    """
    if not 0.0 < gpu_memory_utilization < 1.0:
        raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}")
    fixed = dict(_FIXED_SERVER_ARGS)
    if on_cpu:
        from mppo.rollout.sglang_cpu import CPU_SERVER_ARGS

        fixed.update(CPU_SERVER_ARGS)
    if max_total_tokens is not None:
        fixed["max_total_tokens"] = int(max_total_tokens)
    if return_routed_experts:
        fixed["enable_return_routed_experts"] = True
    if lora is not None:
        fixed.update(enable_lora=True, max_lora_rank=int(lora["rank"]),
                     lora_target_modules=list(lora["target_modules"]), max_loras_per_batch=1)
        if on_cpu:
            fixed["lora_backend"] = "torch_native"
    extra = dict(extra or {})
    clashes = sorted(set(extra) & set(fixed))
    if clashes:
        raise ValueError(f"SGLang server args {clashes} are fixed by mppo's rollout contract and cannot be overridden")
    args = {
        "model_path": model_path,
        "tp_size": tp_size,
        "mem_fraction_static": gpu_memory_utilization,
        "dtype": dtype,
        "base_gpu_id": base_gpu_id,
        "random_seed": seed,
        "log_level": "error",
        # A co-located engine idles through every training phase; without this its scheduler busy-polls a core
        # (which the trainer needs). It sleeps in a zmq poll that a new request ends at once.
        "sleep_on_idle": True,
        "trust_remote_code": trust_remote_code,
        **fixed,
    }
    args.update(extra)
    return args


def build_generate_request(
    prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int, prompt_indices: list[int]
) -> tuple[list[list[int]], list[dict[str, Any]], list[tuple[int, int]]]:
    """One SGLang request per (prompt, sample), prompt-major, each with its own sampling_seed.

    SGLang's `n` is not used: its parallel samples would share one seed. Prompts repeated n times hit the radix
    cache, so the prefill is still shared.
    """
    input_ids, params, keys = [], [], []
    for prompt, prompt_index in zip(prompt_token_ids, prompt_indices, strict=True):
        for sample_index in range(sampling.n):
            input_ids.append(list(prompt))
            params.append(
                {
                    "n": 1,
                    "max_new_tokens": sampling.max_new_tokens,
                    "temperature": 0.0 if sampling.greedy else sampling.temperature,
                    "top_p": 1.0 if sampling.greedy else sampling.top_p,
                    "top_k": -1 if sampling.greedy else sampling.top_k,
                    "stop_token_ids": list(sampling.stop_token_ids),
                    "ignore_eos": sampling.ignore_eos,  # SGLang then ignores stop_token_ids and eos ids alike
                    "sampling_seed": sample_seed(sampling.seed, step, prompt_index, sample_index),
                }
            )
            keys.append((prompt_index, sample_index))
    return input_ids, params, keys


def build_continuation_request(prompt_token_ids: list[list[int]], partial: list[RolloutResponse],
                               sampling: SamplingParams, step: int
                               ) -> tuple[list[list[int]], list[dict[str, Any]], list[tuple[int, int]]]:
    """Partial rollouts: one request per interrupted response, its prompt + tokens as the input (a re-prefill on
    the new weights), for the tokens it may still generate, seeded from its own seed and how far it got."""
    input_ids, params, keys = [], [], []
    for prompt, response in zip(prompt_token_ids, partial, strict=True):
        prefix = list(prompt) + list(response.token_ids)
        _, (one,), _ = build_generate_request([prefix], dataclasses.replace(sampling, n=1), step,
                                              [response.prompt_index])
        one["max_new_tokens"] = sampling.max_new_tokens - len(response.token_ids)
        one["sampling_seed"] = stable_hash63(
            sample_seed(sampling.seed, step, response.prompt_index, response.sample_index), len(response.token_ids))
        input_ids.append(prefix)
        params.append(one)
        keys.append((response.prompt_index, response.sample_index))
    return input_ids, params, keys


def parse_generate_output(outputs: list[dict[str, Any]], keys: list[tuple[int, int]], *,
                          routes: RouteLayout | None = None, prompt_lengths: list[int] | None = None,
                          allow_abort: bool = False) -> list[RolloutResponse]:
    """Map SGLang's per-request outputs (same order as the requests) to RolloutResponses.

    `routes`: the requests asked for routed experts; each response gets the MoE layers' routes of every token but
    the last (`prompt_lengths[i]` prompt tokens + its response), the CPU engine's alignment. `allow_abort`
    (partial rollouts): a request aborted by mppo comes back with the tokens it has, finish reason "abort"."""
    if len(outputs) != len(keys):
        raise SGLangError(f"SGLang returned {len(outputs)} outputs for {len(keys)} requests")
    responses = []
    for i, (out, (prompt_index, sample_index)) in enumerate(zip(outputs, keys)):
        meta = out["meta_info"]
        finish = meta["finish_reason"]
        accepted = ("stop", "length", "abort") if allow_abort else ("stop", "length")
        if finish is None or finish.get("type") not in accepted:
            raise SGLangError(f"SGLang did not finish prompt {prompt_index} sample {sample_index}: {finish}")
        token_ids = [int(t) for t in out["output_ids"]]
        logprob_entries = meta["output_token_logprobs"] or []  # None: aborted before its first token
        logprob_ids = [int(entry[1]) for entry in logprob_entries]
        if logprob_ids != token_ids:
            raise SGLangError(
                f"SGLang's output_token_logprobs do not match output_ids for prompt {prompt_index} sample "
                f"{sample_index} ({len(logprob_ids)} vs {len(token_ids)} tokens)"
            )
        experts = None
        if routes is not None:
            if not meta.get("routed_experts"):
                raise SGLangError(f"SGLang returned no routed experts for prompt {prompt_index} sample "
                                  f"{sample_index} (was the server started with enable_return_routed_experts?)")
            experts = routes.decode(meta["routed_experts"], prompt_lengths[i] + len(token_ids) - 1)
        responses.append(
            RolloutResponse(
                prompt_index=prompt_index,
                sample_index=sample_index,
                token_ids=token_ids,
                log_probs=[float(entry[0]) for entry in logprob_entries],
                finish_reason=finish["type"],
                routed_experts=experts,
            )
        )
    return responses


def bucket_payload(bucket: list[NamedTensor], api: SGLangAPI) -> tuple[str, dict[str, Any]]:
    """Flatten one bucket into a NEW buffer and serialize it (CUDA IPC handles on GPU) for one engine TP rank.

    Returns the payload and the flattened data; the caller must keep the data alive (and never write into it)
    until SGLang's update_weights_from_tensor call for it has returned. The buffer is always fresh, so the
    exporter may reuse its own bucket memory as soon as this returns.
    """
    flat = api.bucket_cls(named_tensors=bucket)
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    if data["flattened_tensor"].is_cuda:
        api.patch_torch_reductions()  # CUDA IPC handles must name the device by UUID (SGLang's patch; idempotent)
    return api.serializer.serialize(data, output_str=True), data


def check_success(result: Any, what: str) -> None:
    """Raise SGLangError unless an SGLang control call succeeded ((success, message) tuple or .success)."""
    if isinstance(result, tuple):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        success, message = getattr(result, "success", None), getattr(result, "message", "")
    if success is not True:
        raise SGLangError(f"SGLang {what} failed: {message if message else repr(result)}")
