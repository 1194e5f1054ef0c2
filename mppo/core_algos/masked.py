"""Masked reductions and small tensor helpers (veRL 0.9.1 `verl.utils.torch_functional` semantics).

Every reduction here is over **all** masked elements of the tensor unless `axis` is given: nothing is per-row
by default. Expressions keep veRL's operation order and let the mask keep its own dtype (bool, int or float), so
results are bit-equal to veRL for the same inputs: for example `mask.sum() + 1e-8` is float32 for an integer mask
and float64 for a float64 mask, exactly as in veRL.
"""
from __future__ import annotations

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    "clip_by_value",
]

Axis = int | tuple[int, ...] | None


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """Sum of `values * mask` over `axis` (all elements when None).

    Positions where `mask == 0` are replaced by 0 before the product, so NaN/inf outside the mask cannot leak in.
    A float mask acts as weights (`values * mask`).
    """
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """`masked_sum(values, mask, axis) / (mask.sum(axis) + 1e-8)`: an all-zero mask gives 0, not NaN."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked elements; `unbiased=True` applies Bessel's correction N/(N-1) with N = mask.sum().

    Raises ValueError when the mask selects no element, or (unbiased) exactly one element, since N/(N-1) would
    divide by zero there.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element; at least two are needed for the variance.")
        if n == 1:
            raise ValueError(
                "masked_var: the mask selects exactly one element, so the unbiased variance divides by zero; "
                "use a larger batch (more valid tokens) or unbiased=False."
            )
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(values - mean) * rsqrt(var + 1e-8)` with batch-wide masked mean and **unbiased** masked variance.

    veRL quirk kept: the result is NOT re-masked; positions with mask 0 are whitened too (`(v - mean) / std`).
    With `shift_mean=False` the mean is added back after scaling.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: `logsumexp(l) - sum(softmax(l) * l)`; shape `logits.shape[:-1]`."""
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """`max(min(x, tensor_max), tensor_min)` with tensor-valued (broadcastable) bounds; the lower bound wins if
    the bounds cross."""
    return torch.max(torch.min(x, tensor_max), tensor_min)
