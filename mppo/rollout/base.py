"""The rollout engine interface: sampling parameters, responses, and the engine life cycle.

Life cycle (the same for every engine, and the same contract as SGLang's memory saver):

    engine = SomeEngine(...)            # weights allocated but hold no values yet
    engine.update_weights(stream)       # weights now hold the actor's values
    engine.generate(...)                # -> list[RolloutResponse]
    engine.release()                    # frees weights AND KV cache for training
    ...train...
    engine.update_weights(stream)       # re-allocates weight memory, then loads the new values
    (trainer offloads its own state here, so the KV cache has room)
    engine.resume()                     # re-allocates the KV cache
    engine.generate(...)

Released weights hold no values (SGLang frees them, the CPU engine drops their storage), so `resume()` after
`release()` requires a fresh `update_weights()` first; `generate()` requires both.

Log-prob semantics (`RolloutResponse.log_probs`): the log-probability of each sampled token under
softmax(logits / temperature) over the FULL vocabulary, without top-k/top-p renormalisation. This is what SGLang
(and veRL's rollout) return, and what the actor recomputes at the same temperature, so the two agree. For greedy
decoding (do_sample=False or temperature=0) it is log_softmax(logits) at temperature 1, again as SGLang does.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, Union

import torch

# "abort": interrupted by a weight update (partial rollouts, mppo.rollout.partial), to be continued; the trainer
# never sees it
FinishReason = Literal["stop", "length", "abort"]
NamedTensor = tuple[str, torch.Tensor]
# The exporter's stream: (hf_name, tensor) pairs, or buckets (lists) of them.
WeightStream = Iterable[Union[NamedTensor, Sequence[NamedTensor]]]


class RolloutStateError(RuntimeError):
    """An engine method was called in the wrong life-cycle state (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. top_k=-1 and top_p=1.0 disable those filters; do_sample=False or temperature=0 is greedy.

    `seed` is the run seed: each sample's random stream is derived from (seed, step, global prompt index,
    sample index), see mppo.rollout.seeding.

    `ignore_eos` (SGLang's and veRL's name) disables every token-based stop: neither `stop_token_ids` nor the
    model config's eos ids end a sample, so each one runs to exactly `max_new_tokens` ("length"), stop tokens
    included as ordinary tokens (fixed-length benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    do_sample: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or an int >= 1, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class RolloutResponse:
    """One sample. token_ids include the stop token when finish_reason == "stop"; log_probs align with token_ids."""

    prompt_index: int  # GLOBAL prompt index (the same whatever the DP split)
    sample_index: int
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    # routing replay (R3): the MoE experts the engine chose for every token it ran, prompt then response,
    # [len(prompt) + len(token_ids) - 1, MoE layers, top_k] int32 (the last token is never fed back); None when not
    # recorded
    routed_experts: torch.Tensor | None = None
    # multi-turn responses (mppo.rollout.agent_loop), None otherwise: 1 on each token the model generated, 0 on the
    # tool turns' tokens (attended, not trained on); and the tool calls the conversation made
    loss_mask: list[int] | None = None
    num_tool_calls: int | None = None
    # the policy version (trainer steps done) of the weights that generated it, the oldest of them under partial
    # rollouts; set by the Rollout that returns it
    policy_version: int | None = None
    # partial rollouts (async_training.partial_rollout): the policy version that generated each token; else None
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"RolloutResponse for prompt {self.prompt_index} sample {self.sample_index}: "
                f"{len(self.token_ids)} token ids but {len(self.log_probs)} log-probs"
            )
        if self.finish_reason not in ("stop", "length", "abort"):
            raise ValueError(f"finish_reason must be 'stop', 'length' or 'abort', got {self.finish_reason!r}")
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"RolloutResponse for prompt {self.prompt_index} sample {self.sample_index}: "
                             f"{len(self.token_ids)} token ids but {len(self.token_versions)} token versions")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"RolloutResponse for prompt {self.prompt_index} sample {self.sample_index}: "
                             f"{len(self.token_ids)} token ids but a loss mask of {len(self.loss_mask)}")


def iter_weight_buckets(named_tensors: WeightStream) -> Iterator[list[NamedTensor]]:
    """Normalise the exporter's stream into buckets: a bare (name, tensor) pair becomes a bucket of one."""
    for item in named_tensors:
        if _is_named_tensor(item):
            yield [item]  # type: ignore[list-item]
            continue
        bucket = list(item)  # type: ignore[arg-type]
        for entry in bucket:
            if not _is_named_tensor(entry):
                raise TypeError(
                    "update_weights expects (hf_name, tensor) pairs or buckets (lists) of them; "
                    f"got a bucket entry of type {type(entry).__name__}"
                )
        yield bucket


def _is_named_tensor(item: object) -> bool:
    return (
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
    )


def validate_prompts(prompt_token_ids: list[list[int]], prompt_offsets: list[int] | None) -> list[int]:
    """Check the prompts and return the global index of each (prompt_offsets, or 0..len-1 when None)."""
    if not prompt_token_ids:
        raise ValueError("generate() got no prompts")
    for i, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if any((not isinstance(t, int)) or t < 0 for t in prompt):
            raise ValueError(f"prompt {i} must be a list of non-negative int token ids")
    if prompt_offsets is None:
        return list(range(len(prompt_token_ids)))
    indices = [int(i) for i in prompt_offsets]
    if len(indices) != len(prompt_token_ids):
        raise ValueError(
            f"prompt_offsets gives the global index of each prompt: expected {len(prompt_token_ids)} entries, "
            f"got {len(indices)}"
        )
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ValueError("prompt_offsets must be distinct non-negative global prompt indices")
    return indices


class RolloutEngine(ABC):
    """A rollout engine. Subclasses implement the underscored hooks; this class enforces the life cycle."""

    # partial rollouts: generate(interrupt=...) and continue_generation (the _generate_interruptible and _continue
    # hooks)
    supports_partial_rollout = False

    def __init__(self) -> None:
        # LoRA adapter-only sync (lora.merge=false): the engine holds the frozen base through release() and takes
        # only the adapters at each sync (update_adapter); a release then frees the KV cache alone
        self.keeps_weights_on_release = False
        self._weights_resident = True  # weight memory allocated
        self._weights_loaded = False  # weights hold values pushed by update_weights since start / last release
        self._kv_resident = True  # KV cache memory allocated

    # ---- public API -------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        step: int,
        prompt_offsets: list[int] | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[RolloutResponse]:
        """Sample `sampling.n` responses per prompt. Returned prompt-major: prompt 0's samples 0..n-1, then prompt 1's.

        `prompt_offsets[i]` is the GLOBAL index of prompt i (None: 0..len-1). Together with `step` and
        `sampling.seed` it seeds each sample, so DP ranks that each generate a slice of the global prompt list
        produce exactly what one rank generating all of them would.

        `interrupt` (partial rollouts): asked as generation goes; once it returns True the samples still running
        stop with finish reason "abort", for continue_generation to take on (on new weights).
        """
        indices = self._check_generate(prompt_token_ids, prompt_offsets, step, interrupt)
        if interrupt is not None:
            return self._generate_interruptible(prompt_token_ids, sampling, step, indices, interrupt)
        return self._generate(prompt_token_ids, sampling, step, indices)

    def continue_generation(self, prompt_token_ids: list[list[int]], partial: list[RolloutResponse],
                            sampling: SamplingParams, *, step: int,
                            interrupt: Callable[[], bool] | None = None) -> list[RolloutResponse]:
        """Go on with each interrupted response (finish reason "abort"; prompt_token_ids[i] is partial[i]'s
        prompt) on the weights loaded now, from the token it stopped at, in its own random stream, up to
        `sampling.max_new_tokens` in all: the tokens each adds, with the finish reason of the whole."""
        if any(r.finish_reason != "abort" for r in partial) or len(partial) != len(prompt_token_ids):
            raise ValueError("continue_generation() takes the interrupted responses (finish reason 'abort') and "
                             "their prompts, one each")
        if not partial:
            return []
        self._check_generate(prompt_token_ids, [r.prompt_index for r in partial], step, interrupt, unique=False)
        return self._continue(prompt_token_ids, partial, sampling, step, interrupt)

    def _check_generate(self, prompt_token_ids: list[list[int]], prompt_offsets: list[int] | None, step: int,
                        interrupt: Callable[[], bool] | None, unique: bool = True) -> list[int]:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"generate() needs the training step as an int >= 0, got {step!r}")
        if interrupt is not None and not self.supports_partial_rollout:
            raise NotImplementedError(f"{type(self).__name__} cannot interrupt a generation (partial rollouts, "
                                      "async_training.partial_rollout); use actor_rollout_ref.rollout.name=cpu")
        if unique:
            indices = validate_prompts(prompt_token_ids, prompt_offsets)
        else:  # continuations: a prompt's samples each continue on their own
            validate_prompts(prompt_token_ids, None)
            indices = list(prompt_offsets or [])
        if not self._weights_loaded:
            raise RolloutStateError(
                "generate() before update_weights(): the engine's weights hold no values yet "
                "(after start-up or release()); push the actor's weights with update_weights() first"
            )
        if not self._kv_resident:
            raise RolloutStateError("generate() while the KV cache is released: call resume() after update_weights()")
        return indices

    def update_weights(self, named_tensors: WeightStream) -> None:
        """Load a FULL set of HF-named weights from the exporter's stream of (hf_name, tensor) pairs or buckets."""
        if not self._weights_resident:
            self._resume_weight_memory()
            self._weights_resident = True
        self._weights_loaded = False  # a failed or partial update leaves unusable weights
        self._load_weights(iter_weight_buckets(named_tensors))
        self._weights_loaded = True

    @property
    def weights_loaded(self) -> bool:
        """The weights hold values pushed by update_weights (since start-up or the last release that freed them)."""
        return self._weights_loaded

    def update_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Serve with these LoRA adapters on the loaded (base) weights from now on, replacing the previous ones.
        `tensors`: full PEFT adapter tensors (mppo.models.lora_io keys), `config`: PEFT's adapter_config.json."""
        if not self._weights_loaded:
            raise RolloutStateError("update_adapter() before update_weights(): the engine holds no base weights to "
                                    "adapt; push the base with update_weights() first")
        self._load_adapter(tensors, config)

    def release(self) -> None:
        """Free weights and KV cache (for training); with keeps_weights_on_release the KV cache only. Idempotent."""
        if self._kv_resident or (self._weights_resident and not self.keeps_weights_on_release):
            self._release_memory()
        self._kv_resident = False
        if not self.keeps_weights_on_release:
            self._weights_resident = False
            self._weights_loaded = False

    def resume(self) -> None:
        """Re-allocate the KV cache after release(). Requires update_weights() since the release. Idempotent."""
        if self._kv_resident:
            return
        if not self._weights_loaded:
            raise RolloutStateError(
                "resume() after release() needs update_weights() first: released weights hold no values "
                "(SGLang's release/resume_memory_occupation has the same contract)"
            )
        self._resume_kv_cache()
        self._kv_resident = True

    def flush_cache(self) -> None:
        """Drop cached prefixes (KV computed with older weights)."""
        self._flush_cache()

    # ---- engine hooks -----------------------------------------------------------------------------------------
    @abstractmethod
    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int, prompt_indices: list[int]
    ) -> list[RolloutResponse]: ...

    @abstractmethod
    def _load_weights(self, buckets: Iterator[list[NamedTensor]]) -> None: ...

    @abstractmethod
    def _release_memory(self) -> None: ...

    @abstractmethod
    def _resume_weight_memory(self) -> None: ...

    @abstractmethod
    def _resume_kv_cache(self) -> None: ...

    @abstractmethod
    def _flush_cache(self) -> None: ...

    def _generate_interruptible(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, step: int,
                                prompt_indices: list[int], interrupt: Callable[[], bool]) -> list[RolloutResponse]:
        raise NotImplementedError  # engines with supports_partial_rollout = True implement it

    def _continue(self, prompt_token_ids: list[list[int]], partial: list[RolloutResponse], sampling: SamplingParams,
                  step: int, interrupt: Callable[[], bool] | None) -> list[RolloutResponse]:
        raise NotImplementedError  # engines with supports_partial_rollout = True implement it

    def _load_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes merged weights only (lora.merge=true); adapter-only "
                                  "sync needs SGLang's LoRA support (rollout.name=sglang)")
