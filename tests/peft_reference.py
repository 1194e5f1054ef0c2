"""HF transformers + a PEFT LoRA adapter directory (`peft.PeftModel.from_pretrained`), the independent reference
for mppo's LoRA. Nothing of mppo is used here. peft is in the `test` extra (pinned in constraints-cpu.txt).
"""
from __future__ import annotations

from pathlib import Path

import torch

HAVE_PEFT = True  # reported in the worker results: the reference is the real package


def random_adapter_tensors(shapes: dict[str, tuple[int, int]], layers: int, projections, rank: int,
                           seed: int) -> dict[str, torch.Tensor]:
    """Full PEFT tensors with B != 0 for `projections` of every layer (shapes: HF projection -> (out, in))."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for proj in projections:
            module = f"model.layers.{layer}.{'self_attn' if proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}"
            o, i = shapes[proj]
            out[f"base_model.model.{module}.{proj}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.2
            out[f"base_model.model.{module}.{proj}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.2
    return out


def with_adapter(hf_model, adapter_dir: Path):
    """`hf_model` with the adapter of `adapter_dir` applied by PEFT."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()
