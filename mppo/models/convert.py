"""`mppo convert`: HF safetensors <-> megatron dist checkpoints.

    mppo convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--dtype auto|float32|bfloat16|float16]
    mppo convert mcore-to-hf --ckpt DIR --out DIR [--tp N --pp N --ep N] [--dtype ...]

One process (tp = pp = ep = 1), or under torchrun with a world size that is a multiple of TP x PP x EP (EP, the
expert parallel size of a MoE model, splits its experts over data-parallel ranks). A checkpoint written at one
TP x PP x EP loads at any other. The output directory is written atomically. Also runnable as
`python -m mppo.models.convert ...`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mppo.models.builders import build_gpt_model
from mppo.models.checkpoint import checkpoint_hf_dir, load_model_checkpoint, save_model_checkpoint
from mppo.models.hf_config import HFModelArgs, UnsupportedModelError, hf_dtype, read_hf_config
from mppo.models.spec import TRANSFORMER_IMPLS
from mppo.models.weights import iter_hf_weights, load_hf_weights, save_hf_checkpoint
from mppo.parallel import ParallelLayoutError, destroy, init_distributed

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
    return parser


def _dtype(choice: str, args: HFModelArgs) -> torch.dtype:
    if choice != "auto":
        return getattr(torch, choice)
    return hf_dtype(args) or torch.float32


def hf_to_mcore(hf_dir: Path, out: Path, *, tp: int, pp: int, ep: int = 1, dtype: str = "auto",
                transformer_impl: str = "auto", overwrite: bool = False) -> None:
    """Read an HF model into TP x PP (x EP) shards and save it as an mppo model checkpoint (collective)."""
    args = read_hf_config(hf_dir)
    dims = init_distributed(tp, pp, ep=ep)
    chunks = build_gpt_model(args, dims, dtype=_dtype(dtype, args), transformer_impl=transformer_impl)
    load_hf_weights(chunks, hf_dir, args)
    save_model_checkpoint(chunks, out, args, tokenizer_dir=hf_dir, overwrite=overwrite)


def mcore_to_hf(ckpt: Path, out: Path, *, tp: int, pp: int, ep: int = 1, dtype: str = "auto",
                transformer_impl: str = "auto", overwrite: bool = False) -> None:
    """Load an mppo model checkpoint at TP x PP (x EP) and write HF safetensors + config + tokenizer (collective)."""
    hf_meta = checkpoint_hf_dir(ckpt)
    args = read_hf_config(hf_meta)
    dims = init_distributed(tp, pp, ep=ep)
    torch_dtype = _dtype(dtype, args)
    chunks = build_gpt_model(args, dims, dtype=torch_dtype, transformer_impl=transformer_impl)
    load_model_checkpoint(chunks, ckpt)
    # One dtype for every tensor (megatron keeps some parameters, e.g. the local spec's norms, in fp32).
    save_hf_checkpoint(iter_hf_weights(chunks, args, dtype=torch_dtype), out, args, tokenizer_dir=hf_meta,
                       dtype=torch_dtype if torch_dtype != hf_dtype(args) else None, overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    owns_process_group = not dist.is_initialized()
    kwargs = dict(tp=opts.tp, pp=opts.pp, ep=opts.ep, dtype=opts.dtype, transformer_impl=opts.transformer_impl,
                  overwrite=opts.overwrite)
    rank0 = True
    try:
        if opts.direction == "hf-to-mcore":
            hf_to_mcore(opts.hf, opts.out, **kwargs)
        else:
            mcore_to_hf(opts.ckpt, opts.out, **kwargs)
        rank0 = dist.get_rank() == 0
    except (FileNotFoundError, FileExistsError, ParallelLayoutError, UnsupportedModelError, ImportError) as err:
        print(f"mppo convert: error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy(process_group=owns_process_group)
    if rank0:
        print(f"mppo convert {opts.direction}: wrote {opts.out}")
    return 0


if __name__ == "__main__":  # the guard also keeps dist_checkpointing's spawned Manager from re-running main
    sys.exit(main(sys.argv[1:]))
