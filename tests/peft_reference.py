"""HF transformers + a PEFT LoRA adapter directory, as the independent reference for mppo's LoRA.

With `peft` installed this is `peft.PeftModel.from_pretrained`. Without it (the shared test venv has no peft), the
adapter is applied by hand the way PEFT's LoRA Linear computes it, reading only the files: every
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight` pair of adapter_model.safetensors adds
`lora_B(lora_A(x)) * lora_alpha / r` to `<module>`'s output (PEFT's format, docs/developer_guides/checkpoint.md).
Nothing of mppo is used here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

try:
    import peft  # noqa: F401
    HAVE_PEFT = True
except ImportError:
    HAVE_PEFT = False


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
    """`hf_model` with the adapter of `adapter_dir` applied (PEFT when installed, else by hand; in place)."""
    if HAVE_PEFT:
        from peft import PeftModel

        return PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and not config.get("use_rslora") and not config.get("use_dora")
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        assert module.rsplit(".", 1)[1] in config["target_modules"], module
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]

        def hook(_, inputs, output, a=a, b=b):
            return output + torch.nn.functional.linear(torch.nn.functional.linear(inputs[0], a), b) * scale

        hf_model.get_submodule(module).register_forward_hook(hook)
    return hf_model
