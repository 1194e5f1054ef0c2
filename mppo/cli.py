"""The `mppo` command: `mppo train` here, every other subcommand dispatched to the module that owns it.

Works as the console script, as `python -m mppo ...` and under `torchrun -m mppo train ...` (then every rank
loads and validates the config against torchrun's WORLD_SIZE; only rank 0 prints).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
import time
import warnings
from typing import Sequence

from mppo.config import to_yaml  # light: omegaconf + yaml, no torch
from mppo.errors import UserError

# subcommand -> (module whose `main(argv: list[str]) -> int` runs it, one-line help). "{name}" in the module is
# replaced by the subcommand's first argument (`mppo bench kernels` -> mppo.bench.kernels). One line per command.
TOOLS: dict[str, tuple[str, str]] = {
    "convert": ("mppo.models.convert", "convert checkpoints: hf-to-mcore, mcore-to-hf"),
    "data": ("mppo.data.cli", "generate task datasets (countdown, multiply) as parquet"),
    "bench": ("mppo.bench.{name}", "run a benchmark: mppo bench NAME (kernels, weight-sync, ...)"),
    "plan": ("mppo.plan", "estimate per-GPU memory and step time of a config"),
    "doctor": ("mppo.doctor", "check the installed GPU stack and what works"),
    "sft": ("mppo.sft", "supervised fine-tuning (warm-up) of a model"),
}
USER_ERROR = 2  # exit code of a user mistake (same as argparse's)
RANK0_GRACE_S = 30  # how long another rank waits for rank 0 to print a config error both found


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _error(message: str, every_rank: bool = False) -> int:
    """Print a user error (no traceback). Config errors are the same on every rank: rank 0 alone says it."""
    if every_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print(f"mppo: error [rank {os.environ.get('RANK', '?')}]: {message}", file=sys.stderr)
    elif _is_rank0():
        print(f"mppo: error: {message}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun kills the remaining ranks as soon as one exits, so a rank that stopped first would cut rank 0
        # off before it says what is wrong. Rank 0 makes the same check and fails with the same error: wait for it
        # (torchrun ends this rank when rank 0 exits), long enough for a loaded machine, bounded in case it doesn't.
        time.sleep(RANK0_GRACE_S)
    return USER_ERROR


# What a subcommand may raise for bad user input (a missing file, a bad value); anything else keeps its traceback.
USER_INPUT_ERRORS = (UserError, FileNotFoundError)  # ConfigError is a UserError


def _missing(exc: ModuleNotFoundError, module: str) -> bool:
    """True when `exc` says `module` itself (or a package above it) does not exist, not one of its imports."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


# ------------------------------------------------------------------------------------------------------------ train
def _train(args: argparse.Namespace) -> int:
    path, overrides = None, list(args.items)
    if overrides and "=" not in overrides[0]:
        path = overrides.pop(0)
    for item in overrides:
        if "=" not in item:
            return _error(f"'{item}' is not a key=value override (the config file, if any, comes first)")
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    from mppo.preflight import load_checked, print_warnings

    try:
        # what the trainer rejects from the config alone, --dry-run rejects too; what it needs of this machine
        # (the rollout engine's package) the trainer refuses at start-up, and --dry-run only warns of
        cfg, notes = load_checked(path, overrides, world_size=world_size, planning=args.dry_run)
    except USER_INPUT_ERRORS as e:
        return _error(str(e))
    if _is_rank0():
        print_warnings(notes)
    if args.dry_run:
        if _is_rank0():
            sys.stdout.write(to_yaml(cfg))
            try:
                _print_plan(cfg)
            except USER_INPUT_ERRORS as e:  # e.g. a TP that does not divide the model's KV heads (PlanError)
                return _error(str(e))
        return 0
    _configure_run_logging()
    trainer = importlib.import_module("mppo.trainer")
    try:
        return int(trainer.run(cfg) or 0)
    except USER_INPUT_ERRORS as e:
        return _error(str(e), every_rank=True)


def _print_plan(cfg) -> None:
    """Append the memory/step-time plan to --dry-run output when the model's config.json is at hand."""
    from mppo.plan import model_args, plan, render_text

    try:
        hf_args, name = model_args(cfg, None)
    except UserError as e:
        print(f"# plan: not computed ({e}); `mppo plan CONFIG --hf-config auto` plans with a built-in config")
        return
    device = "cpu" if cfg.trainer.device == "cpu" else "h100"
    text = render_text(plan(cfg, hf_args, model_name=name, device=device))
    print("# plan (mppo plan):\n" + "\n".join(f"# {line}" for line in text.splitlines()))


# megatron-core announces its fallbacks for GPU-only packages (apex, Transformer Engine) on every import; on a
# machine without them that is the expected path, not news.
_EXPECTED_FALLBACK_WARNINGS = (r".*Apex is not installed.*", r".*Transformer Engine and Apex are not installed.*",
                               r"full scope is deprecated.*", r"The \.grad attribute of a Tensor that is not a leaf",
                               r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")


def _configure_run_logging() -> None:
    """INFO logs tagged with the rank, so a multi-rank run says what each rank is doing."""
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for pattern in _EXPECTED_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        import torch

        if not torch.cuda.is_available():  # CUDA advice from megatron's TP layers: nothing to act on without CUDA
            warnings.filterwarnings("ignore", message=r"When using async grad allreduce.*CUDA_DEVICE_MAX_CONNECTIONS")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it lists every parameter at INFO


# ---------------------------------------------------------------------------------------------------------- tools
def _available_benchmarks() -> list[str]:
    try:
        package = importlib.import_module("mppo.bench")
    except ModuleNotFoundError:
        return []
    names = (m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))
    return sorted(name.replace("_", "-") for name in names)


def _run_tool(command: str, argv: list[str]) -> int:
    module = TOOLS[command][0]
    if "{name}" in module:
        if not argv or argv[0].startswith("-"):
            known = ", ".join(_available_benchmarks()) or "none yet"
            return _error(f"usage: mppo {command} NAME [ARGS...]; available: {known}")
        name, argv = argv[0], argv[1:]
        module = module.format(name=name.replace("-", "_"))
    try:
        tool = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not _missing(e, module):
            raise  # the tool exists but one of its imports is missing: a real problem, keep the traceback
        if "{name}" in TOOLS[command][0] and _available_benchmarks():
            return _error(f"unknown {command} '{name}'; available: {', '.join(_available_benchmarks())}")
        return _error(f"'mppo {command}' is not available yet: its module {module} has not landed")
    try:
        return int(tool.main(argv) or 0)
    except USER_INPUT_ERRORS as e:
        return _error(str(e), every_rank=True)


# ----------------------------------------------------------------------------------------------------------- main
def _add_train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("items", nargs="*", metavar="[CONFIG.yaml] key=value",
                       help="an optional YAML config followed by dotted overrides (veRL/Hydra style)")
    train.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")


TRAIN_HELP = "train a PPO/GRPO config (with --dry-run: validate it and print the resolved config)"
TRAIN_DESCRIPTION = ("Load CONFIG.yaml over the defaults, apply key=value overrides, validate, and train. "
                     "Example: mppo train configs/demo_cpu.yaml trainer.seed=1 --dry-run")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser, for `mppo --help` and unknown commands; subcommands parse their own arguments."""
    parser = argparse.ArgumentParser(prog="mppo", description="Megatron-style PPO/GRPO trainer for LLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train_arguments(sub.add_parser("train", help=TRAIN_HELP, description=TRAIN_DESCRIPTION))
    for command, (_, text) in TOOLS.items():
        sub.add_parser(command, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in TOOLS:
            return _run_tool(argv[0], argv[1:])  # the tool parses its own arguments
        if argv and argv[0] == "train":
            train = argparse.ArgumentParser(prog="mppo train", description=TRAIN_DESCRIPTION)
            _add_train_arguments(train)
            # intermixed: `mppo train cfg.yaml --dry-run a=1 b=2` keeps every override after the flag
            return _train(train.parse_intermixed_args(argv[1:]))
        build_parser().parse_args(argv)  # prints help or a usage error and exits
        return USER_ERROR
    except SystemExit as e:  # argparse printed usage or help, or a tool called sys.exit
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): what Python itself would do
        return 1
