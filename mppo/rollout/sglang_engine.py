"""The production rollout engine: one sglang.Engine per rollout-TP group, co-located on the training GPUs.

Every rank of a rollout-TP group constructs a SGLangRolloutEngine with the same `tp_group` (a gloo group of those
ranks, on consecutive local GPUs starting at `base_gpu_id`) and calls every method collectively. The group's first
rank (the driver) owns the sglang.Engine (tp_size = group size); the others take part in weight pushes and receive
the driver's results.

Weight sync, per update (SGLang >= 0.5.23 requires the begin/end session):
  driver: begin_weight_update()
  per bucket: every rank flattens ITS copy of the bucket (on its own GPU) into a fresh buffer and serializes it
    (CUDA IPC handles) -> gather to the driver -> update_weights_from_tensor([payload of TP rank 0, 1, ...],
    load_format="flattened_bucket", flush_cache=False) -> the driver broadcasts the status, and only then does
    any rank drop its buffer. Buffers are never reused or written after serialization; torch's CUDA IPC keeps a
    shared block allocated until the consumer has released it (it syncs its stream first), and
    torch.cuda.ipc_collect() at the end returns those blocks.
  driver: end_weight_update(), flush_cache() (the radix cache holds KV of the old weights).
Memory dance (mppo.rollout.base): update_weights() first resumes released weight memory, resume() the KV cache
(after the trainer offloaded its state), release() frees weights, KV cache and CUDA graphs.

Stopping: SGLang also stops at the model config's eos ids, as the CPU engine does; pass the tokenizer's eos as
stop_token_ids. sampling_seed is honoured only with enable_deterministic_inference, which the engine sets on GPUs
(it also selects SGLang's batch-invariant kernels, so any rollout split gives the same samples). On the CPU
(`on_cpu=True`, mppo.rollout.sglang_cpu) SGLang has neither deterministic inference nor the memory saver: seeds
are ignored and release() frees nothing; that module says exactly what holds there.

LoRA adapter-only sync (`lora=`, actor_rollout_ref.model.lora.merge=false): the engine starts with SGLang's LoRA
support (enable_lora; on the CPU its torch-native backend), holds the frozen base pushed once by update_weights,
keeps it through release() (only the KV cache is freed), and takes the adapters at each sync as tensors
(load_lora_adapter_from_tensors, under a new name per version; the previous adapter is unloaded first); every
generate request names the current adapter (lora_path).

Routing replay (R3): with `return_routed_experts=True` the server records the experts each MoE layer chose
(enable_return_routed_experts), every request asks for them, and each RolloutResponse carries the MoE layers'
rows (SGLang's layer axis spans all hidden layers) for every token but the last, as the CPU engine's do.

Start-up failures become one EngineStartError (mppo.rollout.sglang_startup), with SGLang's output in `log_path`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from mppo.rollout.base import NamedTensor, RolloutEngine, RolloutResponse, RolloutStateError, SamplingParams
from mppo.rollout.sglang_startup import start_engine, stop_engine
from mppo.rollout.sglang_protocol import (
    RELEASE_TAGS,
    RESUME_KV_TAGS,
    RESUME_WEIGHT_TAGS,
    RouteLayout,
    SGLangAPI,
    SGLangError,
    build_continuation_request,
    build_generate_request,
    bucket_payload,
    check_success,
    engine_server_args,
    load_sglang_api,
    parse_generate_output,
)

T = TypeVar("T")
# How long release() waits for SGLang's scheduler to retire the last generate's batch (normally milliseconds).
RELEASE_IDLE_TIMEOUT_S = 60.0


class RolloutGroup:
    """The ranks of one rollout-TP group; the first drives the engine. `group=None` is a group of one."""

    def __init__(self, group: Any | None) -> None:
        self._group = group
        if group is None:
            self.size, self.driver_rank, self.is_driver = 1, 0, True
            return
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group)
        self.size, self.driver_rank = len(ranks), ranks[0]
        self.is_driver = dist.get_rank() == self.driver_rank

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on the driver (in group rank order), None elsewhere."""
        if self._group is None:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self.size if self.is_driver else None
        dist.gather_object(obj, gathered, dst=self.driver_rank, group=self._group)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        """The driver's `obj` on every rank."""
        if self._group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.driver_rank, group=self._group)
        return box[0]


class SGLangRolloutEngine(RolloutEngine):
    """Rollout through SGLang (GPU). See the module docstring for the collective calling contract."""

    def __init__(
        self,
        model_path: str,
        *,
        gpu_memory_utilization: float,
        tp_group: Any | None = None,
        dtype: str = "bfloat16",
        base_gpu_id: int = 0,
        seed: int = 0,
        server_args: dict[str, Any] | None = None,
        api: SGLangAPI | None = None,
        on_cpu: bool = False,
        max_total_tokens: int | None = None,
        log_path: Path | None = None,
        name: str = "the rollout engine",
        return_routed_experts: bool = False,
        trust_remote_code: bool = False,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # adapter-only sync: {"rank": r, "target_modules": [HF projections]} (None: merged weights)
        self._lora = lora
        self._adapter_name: str | None = None
        self._adapters_loaded = 0
        if lora is not None:
            self.keeps_weights_on_release = True
        # the routed experts' layout (read before SGLang starts: a dense model fails here, in one line)
        self._routes = RouteLayout.of_model(model_path) if return_routed_experts else None
        self._api = api if api is not None else load_sglang_api(on_cpu=on_cpu)
        self._group = RolloutGroup(tp_group)
        self.on_cpu = on_cpu
        kwargs = engine_server_args(
            model_path,
            tp_size=self._group.size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            base_gpu_id=base_gpu_id,
            seed=seed,
            extra=server_args,
            on_cpu=on_cpu,
            max_total_tokens=max_total_tokens,
            return_routed_experts=return_routed_experts,
            trust_remote_code=trust_remote_code,
            lora=lora,
        )
        # The sglang.Engine on the driver (and the processes it started); None on the other ranks of the group.
        self._started = self._on_driver(
            lambda: start_engine(self._api.engine_cls, kwargs, log_path=log_path, what=name, on_cpu=on_cpu),
            share_result=False)

    @property
    def _engine(self) -> Any:
        """The driver's sglang.Engine (None on the other ranks)."""
        return self._started.engine if self._started is not None else None

    @property
    def is_driver(self) -> bool:
        """This rank drives the group's sglang.Engine (the group's first rank)."""
        return self._group.is_driver

    def get_weight(self, hf_name: str) -> torch.Tensor | None:
        """The engine's current value of one HF-named weight, as fp32, on every rank of the group (collective).

        For checks (it goes through SGLang's get_weights_by_name, a Python list of floats): exact for fp32 and
        bf16 weights. None where SGLang's model class has no get_weights_by_name (Qwen2ForCausalLM in 0.5.23).
        """

        def read() -> torch.Tensor | None:
            values = self._engine.get_weights_by_name(hf_name, truncate_size=1 << 62)
            return None if values is None else torch.tensor(values, dtype=torch.float32)

        return self._on_driver(read)

    def shutdown(self) -> None:
        """Stop the SGLang engine's processes, and only those (collective)."""
        self._on_driver(lambda: stop_engine(self._started), share_result=False)

    # ---- generation -------------------------------------------------------------------------------------------
    @property
    def supports_partial_rollout(self) -> bool:  # type: ignore[override]
        return self._routes is None  # an aborted request's routes would need a merge across versions

    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int, prompt_indices: list[int]
    ) -> list[RolloutResponse]:
        """The driver's prompts are generated; every rank of the group gets the responses."""
        self._check_adapter()
        requests = build_generate_request(prompt_token_ids, sampling, step, prompt_indices)
        return self._on_driver(lambda: self._run(*requests, prompt_lengths=[len(p) for p in requests[0]]))

    def _generate_interruptible(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int,
                                prompt_indices: list[int], interrupt: Callable[[], bool]) -> list[RolloutResponse]:
        self._check_adapter()
        requests = build_generate_request(prompt_token_ids, sampling, step, prompt_indices)
        return self._on_driver(lambda: self._run(*requests, interrupt=interrupt))

    def _continue(self, prompt_token_ids: list[list[int]], partial: list[RolloutResponse], sampling: SamplingParams,
                  step: int, interrupt: Callable[[], bool] | None) -> list[RolloutResponse]:
        self._check_adapter()
        requests = build_continuation_request(prompt_token_ids, partial, sampling, step)
        return self._on_driver(lambda: self._run(*requests, interrupt=interrupt))

    def _check_adapter(self) -> None:
        if self._lora is not None and self._adapter_name is None:
            raise RolloutStateError("generate() on an engine for adapter-only sync that holds no adapter (none loaded "
                                    "yet, or the last load failed): push the adapters with update_adapter() first")

    def _run(self, input_ids: list[list[int]], params: list[dict[str, Any]], keys: list[tuple[int, int]], *,
             prompt_lengths: list[int] | None = None,
             interrupt: Callable[[], bool] | None = None) -> list[RolloutResponse]:
        """One generate call on the driver. `interrupt`: a watcher thread asks it every few milliseconds; once it
        says so, every request is aborted on SGLang's event loop (call_soon_threadsafe: the tokenizer manager is
        not thread-safe) and comes back with the tokens it has, finish reason "abort"."""
        extra: dict[str, Any] = {} if self._adapter_name is None else {"lora_path": [self._adapter_name] * len(keys)}
        if self._routes is not None:
            extra["return_routed_experts"] = True
        watcher = None if interrupt is None else _AbortWatcher(self._engine, interrupt)
        try:
            outputs = self._engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True, **extra)
        finally:
            if watcher is not None:
                watcher.stop()
        if self._routes is None:
            return parse_generate_output(outputs, keys, allow_abort=interrupt is not None)
        return parse_generate_output(outputs, keys, routes=self._routes, prompt_lengths=prompt_lengths)

    # ---- weights ----------------------------------------------------------------------------------------------
    def _load_weights(self, buckets: Iterator[list[NamedTensor]]) -> None:
        self._on_driver(lambda: check_success(self._engine.begin_weight_update(), "begin_weight_update"))
        try:
            while self._push_next_bucket(buckets):
                pass
        except Exception:
            # Close SGLang's session so the next update can open one; the original error is what matters.
            self._on_driver(lambda: self._engine.end_weight_update(), share_result=False)
            raise
        self._on_driver(lambda: check_success(self._engine.end_weight_update(), "end_weight_update"))
        self._on_driver(lambda: check_success(self._engine.flush_cache(), "flush_cache"))
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def _push_next_bucket(self, buckets: Iterator[list[NamedTensor]]) -> bool:
        """Push one bucket from every rank; False once every rank's stream is exhausted."""
        keep_alive = None  # this rank's flattened buffer: alive until the driver reports SGLang's call returned
        try:
            bucket = next(buckets, None)
            if bucket is None:
                local: tuple[str, Any, Any] = ("done", None, None)
            else:
                payload, keep_alive = bucket_payload(bucket, self._api)
                if keep_alive["flattened_tensor"].is_cuda:
                    torch.cuda.current_stream().synchronize()  # the copy into the buffer is complete before use
                local = ("bucket", [name for name, _ in bucket], payload)
        except Exception as exc:
            if self._group.size == 1:
                raise
            # Tell the driver instead of leaving the rest of the group waiting in gather.
            local = ("error", f"rank failed to produce its weight bucket: {type(exc).__name__}: {exc}", None)
        gathered = self._group.gather(local)
        more = self._on_driver(lambda: self._push_gathered(gathered))
        del keep_alive
        return more

    def _push_gathered(self, gathered: list[tuple[str, Any, Any]]) -> bool:
        kinds = {kind for kind, _, _ in gathered}
        errors = [detail for kind, detail, _ in gathered if kind == "error"]
        if errors:
            raise SGLangError("; ".join(errors))
        if kinds == {"done"}:
            return False
        names = [detail for _, detail, _ in gathered]
        if kinds != {"bucket"} or any(n != names[0] for n in names):
            raise SGLangError(
                "the ranks of a rollout-TP group must stream identical weight buckets (same names, same order); "
                f"got {[len(n) if n else 0 for n in names]} names per rank"
            )
        result = self._engine.update_weights_from_tensor(
            named_tensors=[payload for _, _, payload in gathered], load_format="flattened_bucket", flush_cache=False
        )
        check_success(result, "update_weights_from_tensor")
        return True

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        if self._lora is None:
            raise SGLangError("this engine was started without LoRA support (lora.merge=true): it takes merged "
                              "weights only")
        name, previous = f"mppo-adapter-{self._adapters_loaded}", self._adapter_name

        def load() -> None:
            if previous is not None:  # one adapter at a time: SGLang's pool holds max_loras_per_batch
                check_success(self._engine.unload_lora_adapter(previous), "unload_lora_adapter")
            check_success(self._engine.load_lora_adapter_from_tensors(name, tensors, config),
                          "load_lora_adapter_from_tensors")

        self._adapter_name = None  # a failed load leaves no adapter to serve with
        self._on_driver(load)
        self._adapter_name, self._adapters_loaded = name, self._adapters_loaded + 1
        self._flush_cache()  # the radix cache holds KV of the previous adapter

    # ---- memory -----------------------------------------------------------------------------------------------
    def _release_memory(self) -> None:
        self._on_driver(self._release_when_idle)

    def _release_when_idle(self) -> None:
        """release_memory_occupation once SGLang's scheduler is idle. Its generate() returns as soon as the outputs
        are out, but the scheduler may not yet have retired the finished batch (its overlap loop processes a
        batch's results one iteration later), and release_memory_occupation asserts idleness: the scheduler
        process dies. flush_cache checks the same condition without failing (and empties the radix cache, which
        a release discards anyway), so it is retried until it succeeds."""
        deadline = time.monotonic() + RELEASE_IDLE_TIMEOUT_S
        while not _succeeded(self._engine.flush_cache()):
            if time.monotonic() > deadline:
                raise SGLangError(f"SGLang's scheduler was not idle {RELEASE_IDLE_TIMEOUT_S:.0f} s after generate "
                                  "returned; cannot release its memory")
            time.sleep(0.01)
        self._engine.release_memory_occupation(tags=RESUME_KV_TAGS if self.keeps_weights_on_release else RELEASE_TAGS)

    def _resume_weight_memory(self) -> None:
        self._on_driver(lambda: self._engine.resume_memory_occupation(tags=RESUME_WEIGHT_TAGS))

    def _resume_kv_cache(self) -> None:
        self._on_driver(lambda: self._engine.resume_memory_occupation(tags=RESUME_KV_TAGS))

    def _flush_cache(self) -> None:
        self._on_driver(lambda: check_success(self._engine.flush_cache(), "flush_cache"))

    # ---- collective helper ------------------------------------------------------------------------------------
    def _on_driver(self, fn: Callable[[], T], *, share_result: bool = True) -> T:
        """Run `fn` on the driver; every rank then returns its result (or raises if it failed).

        With share_result=False the result stays on the driver (others get None): for objects that cannot or
        need not travel, like the engine itself.
        """
        if self._group.size == 1:
            return fn()
        result, error = None, None
        if self._group.is_driver:
            try:
                result = fn()
            except Exception as exc:
                error = exc
        shared = self._group.broadcast((result if share_result else None, None if error is None else repr(error)))
        if error is not None:
            raise error
        if shared[1] is not None:
            raise SGLangError(f"the rollout-TP group's driver rank {self._group.driver_rank} failed: {shared[1]}")
        return result if self._group.is_driver else shared[0]


def _succeeded(result: Any) -> bool:
    """An SGLang control call's success flag ((success, message) tuple or .success)."""
    return bool(result[0] if isinstance(result, tuple) else getattr(result, "success", False))


class _AbortWatcher:
    """Partial rollouts on the driver: a thread that asks `interrupt` every POLL_S while a generate call runs and,
    the first time it says so, aborts every request of the engine (they return with what they generated)."""

    POLL_S = 0.005

    def __init__(self, engine: Any, interrupt: Callable[[], bool]) -> None:
        import threading

        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(engine, interrupt), name="mppo-sglang-abort",
                                        daemon=True)
        self._thread.start()

    def _watch(self, engine: Any, interrupt: Callable[[], bool]) -> None:
        while not self._done.wait(self.POLL_S):
            if interrupt():
                engine.loop.call_soon_threadsafe(engine.tokenizer_manager.abort_request, "", True)
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
