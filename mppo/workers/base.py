"""What the actor, critic and reference workers share: building a role's model from the config, reading the model's
output at the response positions, and metric reduction over ranks (the forward step is mppo.workers.pipeline's)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.config.decisions import uses_sequence_parallel
from mppo.config.schema import MegatronConfig, ModelConfig
from mppo.models.builders import Role, build_gpt_model, unwrap_model
from mppo.models.hf_config import HFModelArgs, read_hf_config
from mppo.models.lora import apply_lora, lora_spec
from mppo.models.weights import load_hf_weights
from mppo.parallel import ParallelDims
from mppo.workers.batching import Batch
from mppo.workers.moe_losses import moe_loss_overrides
from mppo.workers.router_replay import router_replay_overrides

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dtype(model_cfg: ModelConfig, dims: ParallelDims) -> torch.dtype:
    """Parameter dtype: `model.dtype`, where auto = bf16 on CUDA and fp32 on CPU."""
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if dims.device.type == "cuda" else torch.float32
    return _DTYPES[model_cfg.dtype]


def recompute_overrides(recompute: str | None) -> dict:
    """TransformerConfig keyword arguments for `megatron.recompute` (none | selective | full; on CUDA only:
    mppo.preflight.check_recompute)."""
    if recompute in (None, "none"):
        return {}
    if recompute == "selective":  # the attention core only (megatron's default selective module)
        return {"recompute_granularity": "selective"}
    # full: whole layers, one at a time
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def build_role_model(hf_dir: str | Path, dims: ParallelDims, *, role: Role, model_cfg: ModelConfig,
                     megatron: MegatronConfig, router_replay: str = "disabled",
                     lora_seed: int = 0) -> tuple[HFModelArgs, list[nn.Module], torch.dtype]:
    """(HF facts, model chunks with the HF weights loaded, dtype) for a role (`router_replay`: the actor's mode).
    `lora_seed`: the actor's seed, for its LoRA adapters' initial A. The caller reads it from the actor's own
    section: read here from `megatron` (MegatronConfig, also the reference's and critic's type), the config-key
    scan (tests/test_config_keys_read.py) would count their inert `megatron.seed` as read too."""
    args = read_hf_config(hf_dir)
    dtype = resolve_dtype(model_cfg, dims)
    losses = moe_loss_overrides(megatron, is_moe=args.is_moe) if role != "ref" else {}
    chunks = build_gpt_model(args, dims, role=role, dtype=dtype, transformer_impl=model_cfg.transformer_impl,
                             sequence_parallel=uses_sequence_parallel(megatron) and dims.tp > 1,
                             **recompute_overrides(megatron.recompute), **losses,
                             **router_replay_overrides(router_replay, is_moe=args.is_moe))
    load_hf_weights(chunks, hf_dir, args)
    if role == "actor" and model_cfg.lora.rank > 0:  # LoRA: the base frozen, adapters trained (mppo.models.lora)
        apply_lora(chunks, args, lora_spec(model_cfg.lora, seed=lora_seed), base_dir=str(hf_dir))
    return args, chunks, dtype


def response_rows(output: torch.Tensor, data: Batch, valid_only: bool) -> torch.Tensor:
    """The model output [s, b, ...] at the positions that predict the response tokens.

    valid_only: [N, ...] for the N valid response tokens (row-major); otherwise [b, T, ...].
    """
    index, valid = data["response_index"], data["response_valid"]
    rows = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index)
    if valid_only:
        return output[index[valid], rows[valid]]
    return output[index, rows]


def output_weight(model: nn.Module) -> torch.Tensor:
    """This TP rank's shard of the output (LM head) weight of a last-stage chunk."""
    core = unwrap_model(model)
    if core.share_embeddings_and_output_weights:
        return core.shared_embedding_or_output_weight()
    return core.output_layer.weight


def share_of(value: torch.Tensor, denominator: int | float) -> torch.Tensor:
    """value / denominator as a float64 0-dim tensor on value's device, without a host sync.

    The divisor is a device tensor, not a Python number: CUDA divides by a host scalar as a multiply by its
    reciprocal, which is not bitwise the quotient the host (or the CPU) computes."""
    value = value.detach().double()
    return value / torch.full((), denominator, dtype=torch.float64, device=value.device)


def as_float64(value: torch.Tensor | float) -> torch.Tensor | float:
    """A metric value in float64 where it is (a detached device tensor, or the Python float itself)."""
    return value.detach().double() if isinstance(value, torch.Tensor) else value


class StepMetrics:
    """Per-optimizer-step metric sums over micro-batches, reduced over all ranks in one collective.

    A worker adds each micro-batch's *contribution* to the global value (e.g. loss / dp, or a token-weighted
    fraction); summing them over micro-batches and DP ranks gives the global mini-batch value. Only the last
    pipeline stage's first TP rank of CP rank 0 contributes (the others hold copies). A non-finite loss flag rides along.
    Contributions may be device tensors: they are summed where they are (in float64) and read on the host once,
    in `reduce`, so a micro-batch costs no host sync (which would stall a GPU pipeline schedule).
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.sums: list[torch.Tensor | float] = [0.0] * len(self.keys)
        self.present = [0] * len(self.keys)  # known on the host: which keys some micro-batch reported
        self.nonfinite: list[torch.Tensor] = []  # per micro-batch: 1.0 where its loss was not finite

    def add(self, key: str, contribution: torch.Tensor | float) -> None:
        i = self.keys.index(key)
        if isinstance(contribution, torch.Tensor):
            contribution = contribution.detach().double()
        # the same float64 sums in the same order as on the host: 0.0 + c0 + c1 + ...
        self.sums[i] = self.sums[i] + contribution
        self.present[i] += 1

    def check_finite(self, loss: torch.Tensor) -> None:
        """Flag the step as not to be applied if `loss` is not finite (read in `reduce`, no sync here)."""
        self.nonfinite.append((~torch.isfinite(loss.detach())).any().double())

    def reduce(self, *, contributes: bool, device: torch.device) -> tuple[dict[str, float], bool]:
        """(global metrics that some rank reported, whether any loss was not finite) on every rank (collective
        over the world; the step's one device-to-host read)."""
        n = len(self.keys)
        vec = torch.zeros(2 * n + 1, dtype=torch.float64, device=device)
        if contributes:
            parts = [torch.as_tensor(s, dtype=torch.float64).to(device).reshape(1) for s in self.sums]
            parts.append(torch.tensor(self.present, dtype=torch.float64).to(device))
            flags = [f.to(device).reshape(1) for f in self.nonfinite] or [vec.new_zeros(1)]
            parts.append(torch.cat(flags).sum().reshape(1))
            vec = torch.cat(parts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        vec = vec.cpu()
        metrics = {k: float(vec[i]) for i, k in enumerate(self.keys) if vec[n + i] > 0}
        return metrics, bool(vec[2 * n] > 0)


def mean_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the optimizer steps that report it."""
    keys = {k for s in steps for k in s}
    return {k: sum(s[k] for s in steps if k in s) / sum(1 for s in steps if k in s) for k in sorted(keys)}
