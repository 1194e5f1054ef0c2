"""The reference policy: a frozen copy of the initial actor (no optimizer), for the KL terms; with LoRA, the
actor's own frozen base (its adapters off), not a copy.

With `ref.offload_to_cpu` on a GPU its weights live in host memory and move to the GPU only for the duration
of `compute_log_prob` (slime does the same). On a CPU-only machine the weights are already in host memory,
so the option changes nothing there.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from mppo.config.schema import ModelConfig, RefConfig
from mppo.models.lora import adapters_disabled
from mppo.parallel import ParallelDims
from mppo.workers.base import build_role_model
from mppo.workers.batching import Batch, validate_batch
from mppo.workers.logprob import compute_response_outputs, make_logprob_fn


class ReferenceWorker:
    """Frozen policy on this rank's TP/PP shard. `compute_log_prob` is collective over every rank.

    `ref_cfg` must be resolved (mppo.config fills its nulls from the actor's); `logprob_impl` and
    `kernel_backend` are the actor's settings (actor.logprob_impl, actor.kernel_backend). `max_token_len` set
    makes micro-batches by token budget the default (veRL's ref.log_prob_use_dynamic_bsz, which follows the
    actor's use_dynamic_bsz / ppo_max_token_len_per_gpu); None: by count.
    """

    def __init__(self, model_cfg: ModelConfig, ref_cfg: RefConfig, dims: ParallelDims, hf_dir: str | Path, *,
                 logprob_impl: str = "fused", kernel_backend: str = "auto", max_token_len: int | None = None,
                 lora_actor=None):
        """`lora_actor`: a LoRA ActorWorker whose frozen base is the reference (its adapters switched off for each
        call, mppo.models.lora.adapters_disabled): no model of its own, nothing to offload (veRL does the same)."""
        self.cfg, self.dims = ref_cfg, dims
        self.max_token_len = max_token_len
        self.shares_actor = lora_actor is not None
        if self.shares_actor:
            self.hf_args, self.model, self.dtype = lora_actor.hf_args, lora_actor.model, lora_actor.dtype
        else:
            self.hf_args, self.model, self.dtype = build_role_model(hf_dir, dims, role="ref", model_cfg=model_cfg,
                                                                    megatron=ref_cfg.megatron)
        self.logprob_fn = make_logprob_fn(logprob_impl, kernel_backend)
        self.offload = ref_cfg.offload_to_cpu and dims.device.type != "cpu" and not self.shares_actor
        if self.offload:
            self._move(torch.device("cpu"))

    def _move(self, device: torch.device) -> None:
        for chunk in self.model:
            chunk.to(device)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Weights on the compute device for the block (a no-op unless offloaded)."""
        if not self.offload:
            yield
            return
        self._move(self.dims.device)
        try:
            yield
        finally:
            self._move(torch.device("cpu"))

    def compute_log_prob(self, batch: Batch, *, temperature: float, micro_batch_size: int | None = None,
                         max_token_len: int | None = None) -> torch.Tensor:
        """Reference log-probs [B, T] fp32 of the response tokens on every rank (0 at response padding).
        Micro-batches by count (default: ref.log_prob_micro_batch_size_per_gpu) or by token budget (default when
        the worker has a `max_token_len`)."""
        validate_batch(batch)
        if micro_batch_size is not None and max_token_len is not None:
            raise ValueError("give micro_batch_size (by count) or max_token_len (token budget), not both")
        if micro_batch_size is None and max_token_len is None:
            max_token_len = self.max_token_len
        if micro_batch_size is None and max_token_len is None:
            micro_batch_size = self.cfg.log_prob_micro_batch_size_per_gpu  # resolved: the actor's when null
        batch = {k: v.to(self.dims.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        base = adapters_disabled(self.model) if self.shares_actor else contextlib.nullcontext()
        with torch.no_grad(), self._on_device(), base:
            return compute_response_outputs(
                self.model, batch, self.logprob_fn, vocab_size=self.hf_args.vocab_size, temperature=temperature,
                micro_batch_size=micro_batch_size, max_token_len=max_token_len, phase="ref/log_prob")["log_probs"]
