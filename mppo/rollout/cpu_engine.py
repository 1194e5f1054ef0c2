"""The CPU rollout engine: the HF architecture from a config, weights only from update_weights, batched generation.

For tests and the CPU demo. It takes the same (hf_name, tensor) stream as the SGLang engine, samples with the same
per-sample seeding, and returns log-probs with the same semantics (see mppo.rollout.base). Generation is packed
and batch-invariant (see mppo.rollout.cpu_model): with single-threaded torch a sample's tokens AND log-probs are
bitwise the same whatever else is in the batch.

Stopping: a sample ends at any of `stop_token_ids` or the config's `eos_token_id` (SGLang also stops at the
model config's eos ids), or after `max_new_tokens` ("length"). The KV cache lives only inside a generate() call,
so release() frees the weights (their storage is dropped) and there is no cross-call prefix cache to flush.

Weights arrive under HF checkpoint names. A MoE model's experts are one stream entry per expert and projection
(`mlp.experts.{e}.gate_proj.weight`, ...), which transformers' Qwen3-MoE keeps fused in 3D parameters
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]): each entry is copied into its slice.

Tensors the exporter staged in shared memory (gloo ranks on one host, `is_staged`) are kept as the weights
themselves, without a copy; anything else is copied in. Kept staged weights live in the exporter's staging buffer,
which the next sync rewrites in place and which stays allocated across release() (the exporter reuses it; free it
with mppo.models.weight_transport.release_staging_buffers() on every rank once the engine has released).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from mppo.models.weight_transport import is_staged
from mppo.rollout.base import NamedTensor, RolloutEngine, RolloutResponse, SamplingParams
from mppo.rollout.cpu_decode import Continuation, Result, generate
from mppo.rollout.cpu_model import PackedCausalLM, check_supported
from mppo.rollout.seeding import sample_seed


class CPURolloutEngine(RolloutEngine):
    """Rollout on CPU in float32. Build it from an HF config (e.g. `transformers.AutoConfig.from_pretrained(dir)`).

    `record_routed_experts`: every response also carries the experts each MoE layer chose for each token
    (`RolloutResponse.routed_experts`), for the actor's routing replay (actor.router_replay.mode=R3).
    `trust_remote_code`: the parameter container may be the checkpoint's own class (its config's auto_map); the
    forward is this engine's either way."""

    def __init__(self, hf_config: PretrainedConfig, *, record_routed_experts: bool = False,
                 trust_remote_code: bool = False) -> None:
        super().__init__()
        check_supported(hf_config)
        self._config = hf_config
        self._model = _build_unloaded_model(hf_config, trust_remote_code)
        self._runner = PackedCausalLM(self._model)
        if record_routed_experts and not self._runner.moe_layers:
            raise ValueError(f"recording routed experts needs a MoE model; this {hf_config.model_type} model has no "
                             "MoE layer (set actor_rollout_ref.actor.router_replay.mode=disabled)")
        self._record_routes = record_routed_experts
        # Every accepted name -> its parameter; tied names (lm_head.weight with tied embeddings) share one.
        self._params_by_name = dict(self._model.named_parameters(remove_duplicate=False))
        self._expert_pieces = _expert_pieces(self._model)  # per-expert HF name -> its slice of a fused parameter
        self._fused = {fused_name for fused_name, _, _ in self._expert_pieces.values()}
        self._canonical_names = [name for name, _ in self._model.named_parameters() if name not in self._fused]
        self._canonical_names += list(self._expert_pieces)
        self._param_shapes = {name: param.shape for name, param in self._model.named_parameters()}
        eos = hf_config.eos_token_id
        self._config_eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's current weights by HF checkpoint name (tied names included, one entry per expert weight),
        detached; empty tensors when released."""
        names = [n for n in self._params_by_name if n not in self._fused] + list(self._expert_pieces)
        return {name: self._target(name).detach() for name in names}

    def _target(self, name: str) -> torch.Tensor:
        """The parameter a stream name loads, or for a per-expert name the view of its slice (made anew each time:
        release() and resume swap the fused parameter's storage)."""
        if name in self._expert_pieces:
            fused_name, expert, rows = self._expert_pieces[name]
            fused = self._params_by_name[fused_name]
            return fused[expert, rows] if fused.numel() else fused  # released: an empty tensor
        return self._params_by_name[name]

    def _received_key(self, name: str) -> int | str:
        return name if name in self._expert_pieces else id(self._params_by_name[name])

    # ---- weights ----------------------------------------------------------------------------------------------
    def _load_weights(self, buckets: Iterator[list[NamedTensor]]) -> None:
        received: dict[int | str, str] = {}  # id(parameter) (or a per-expert name) -> name it was loaded from
        with torch.no_grad():
            for bucket in buckets:
                # CPU tensors only: skip the CPU-compat torch-function modes (mppo.parallel.cpu_compat), which add
                # microseconds of Python to every tensor call and only rewrite CUDA arguments.
                with torch._C.DisableTorchFunction():
                    for name, tensor in bucket:
                        self._load_one(name, tensor, received)
        missing = [n for n in self._canonical_names if self._received_key(n) not in received]
        if missing:
            raise KeyError(
                f"update_weights: the stream lacked {len(missing)} of the model's weights, e.g. {missing[:5]}; "
                "every update must carry the full model"
            )

    def _load_one(self, name: str, tensor: torch.Tensor, received: dict[int | str, str]) -> None:
        param = self._lookup(name, tensor)
        key = self._received_key(name)
        first = received.get(key)
        if first is None:
            if (is_staged(tensor) and tensor.dtype == param.dtype and tensor.is_contiguous()
                    and name not in self._expert_pieces):  # a slice of a fused parameter is always copied
                # Keep the exporter's staged view as this weight: no copy now, and later exports write the next
                # values into it in place (mppo.models.weight_transport).
                param.data = tensor
            else:
                param.copy_(tensor)
            received[key] = name
        elif first == name:
            raise ValueError(f"update_weights: weight {name!r} was sent twice in one update")
        elif not torch.equal(param, tensor.to(param.device, param.dtype)):
            raise ValueError(
                f"update_weights: {name!r} is tied to {first!r} in this model but the stream gave them "
                "different values"
            )

    def _lookup(self, name: str, tensor: torch.Tensor) -> torch.nn.Parameter:
        param = self._target(name) if name in self._params_by_name or name in self._expert_pieces else None
        if param is None:
            raise KeyError(
                f"update_weights: unknown weight {name!r} for this {self._config.model_type} model "
                f"(its HF names look like {self._canonical_names[:3]}...)"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
            )
        if not tensor.is_floating_point():
            raise TypeError(f"update_weights: {name!r} has dtype {tensor.dtype}; weights must be floating point")
        return param

    # ---- memory -----------------------------------------------------------------------------------------------
    def _release_memory(self) -> None:
        for _, param in self._model.named_parameters():  # unique parameters: tied ones stay tied
            param.data = torch.empty(0, dtype=param.dtype)

    def _resume_weight_memory(self) -> None:
        for name, param in self._model.named_parameters():
            param.data = torch.empty(self._param_shapes[name], dtype=param.dtype)

    def _resume_kv_cache(self) -> None:
        pass  # the KV cache is allocated per generate() call

    def _flush_cache(self) -> None:
        pass  # no prefix cache survives a generate() call

    # ---- generation -------------------------------------------------------------------------------------------
    supports_partial_rollout = True

    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int, prompt_indices: list[int]
    ) -> list[RolloutResponse]:
        return self._generate_interruptible(prompt_token_ids, sampling, step, prompt_indices, None)

    def _generate_interruptible(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int,
                                prompt_indices: list[int], interrupt: Callable[[], bool] | None
                                ) -> list[RolloutResponse]:
        self._check_prompts(prompt_token_ids, sampling.max_new_tokens)
        seeds = [sample_seed(sampling.seed, step, prompt_indices[p], s)
                 for p in range(len(prompt_token_ids)) for s in range(sampling.n)]
        keys = [(prompt_indices[slot // sampling.n], slot % sampling.n) for slot in range(len(seeds))]
        continuation = None if interrupt is None else Continuation(
            offsets=[0] * len(seeds), budgets=[sampling.max_new_tokens] * len(seeds), interrupt=interrupt)
        out = generate(self._runner, prompt_token_ids, sampling, seeds, self._stop_ids(sampling),
                       self._record_routes, continuation)
        return _responses(keys, out)

    def _continue(self, prompt_token_ids: list[list[int]], partial: list[RolloutResponse], sampling: SamplingParams,
                  step: int, interrupt: Callable[[], bool] | None) -> list[RolloutResponse]:
        if self._record_routes:
            raise NotImplementedError("partial rollouts do not record routed experts (router_replay R3)")
        # each sample on its own: its prompt and what it generated so far are the new prompt (a re-prefill on the
        # new weights), its random stream goes on from the token it stopped at
        prefixes = [list(prompt) + list(r.token_ids) for prompt, r in zip(prompt_token_ids, partial)]
        budgets = [sampling.max_new_tokens - len(r.token_ids) for r in partial]
        if min(budgets) < 1:
            raise ValueError("continue_generation(): a response already holds sampling.max_new_tokens tokens")
        self._check_prompts(prompt_token_ids, sampling.max_new_tokens)
        seeds = [sample_seed(sampling.seed, step, r.prompt_index, r.sample_index) for r in partial]
        continuation = Continuation(offsets=[len(r.token_ids) for r in partial], budgets=budgets, interrupt=interrupt)
        out = generate(self._runner, prefixes, dataclasses.replace(sampling, n=1), seeds, self._stop_ids(sampling),
                       False, continuation)
        return _responses([(r.prompt_index, r.sample_index) for r in partial], out)

    def _check_prompts(self, prompt_token_ids: list[list[int]], max_new_tokens: int) -> None:
        limit = self._config.max_position_embeddings
        longest = max(len(p) for p in prompt_token_ids)
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        vocab = self._config.vocab_size
        if any(t >= vocab for p in prompt_token_ids for t in p):
            raise ValueError(f"a prompt contains a token id >= the vocabulary size {vocab}")

    def _stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        return () if sampling.ignore_eos else tuple(sorted(set(sampling.stop_token_ids) | self._config_eos))


def _responses(keys: list[tuple[int, int]], out: list[Result]) -> list[RolloutResponse]:
    return [RolloutResponse(prompt_index=prompt_index, sample_index=sample_index, token_ids=tokens,
                            log_probs=log_probs, finish_reason=reason,  # type: ignore[arg-type]
                            routed_experts=routes)
            for (prompt_index, sample_index), (tokens, log_probs, reason, routes) in zip(keys, out)]


_FUSED_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def _expert_pieces(model: torch.nn.Module) -> dict[str, tuple[str, int, slice]]:
    """HF checkpoint names of per-expert weights -> (fused parameter name, expert, rows of that expert's matrix)."""
    pieces: dict[str, tuple[str, int, slice]] = {}
    for name, param in model.named_parameters():
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None:
            continue
        prefix, kind = match.groups()
        for e in range(param.shape[0]):
            if kind == "down_proj":
                pieces[f"{prefix}.{e}.down_proj.weight"] = (name, e, slice(None))
            else:
                half = param.shape[1] // 2
                pieces[f"{prefix}.{e}.gate_proj.weight"] = (name, e, slice(0, half))
                pieces[f"{prefix}.{e}.up_proj.weight"] = (name, e, slice(half, None))
    return pieces


def _build_unloaded_model(hf_config: PretrainedConfig, trust_remote_code: bool = False) -> torch.nn.Module:
    """The HF model in float32 with allocated but uninitialised weights (no random init, no global RNG use).

    Built on the meta device, then each parameter gets real storage; parameters shared by several modules
    (tied embeddings) get ONE new parameter so they stay tied. The rotary embedding, the only buffer owner in the
    supported architectures, is rebuilt from the config so its inv_freq holds real values.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    materialised: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in materialised:
                storage = torch.empty(param.shape, dtype=torch.float32)
                materialised[id(param)] = torch.nn.Parameter(storage, requires_grad=False)
            module._parameters[name] = materialised[id(param)]
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=hf_config)
    stray = [n for n, b in model.named_buffers() if b.is_meta]
    if stray:
        raise ValueError(f"unsupported architecture: buffers {stray} would be left without values")
    return model.eval()
