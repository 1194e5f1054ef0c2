"""`mppo plan CONFIG... [key=value ...]`: per-GPU memory, fit verdict and step time of one or more configs."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mppo.config import ConfigError, MppoConfig
from mppo.models.hf_config import HFModelArgs, UnsupportedModelError, read_hf_config
from mppo.plan.catalog import DEVICES, KNOWN_HF_CONFIGS, GiB, known_config
from mppo.plan.memory import PlanError
from mppo.plan.planner import Plan, plan
from mppo.plan.render import render_markdown, render_text
from mppo.preflight import load_checked, print_warnings

DESCRIPTION = ("Estimate the per-GPU memory (actor, critic, reference, activations, log-prob kernel, rollout engine) "
               "and the step time of a config, and say whether it fits. Example: mppo plan "
               "configs/gsm8k_qwen2.5_7b_grpo.yaml --hf-config Qwen2.5-7B --device h200")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo plan", description=DESCRIPTION)
    p.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value",
                   help="config file(s) (each planned) and dotted overrides applied to every one")
    p.add_argument("--hf-config", metavar="NAME",
                   help=f"plan with a built-in model config instead of actor_rollout_ref.model.path's config.json: "
                        f"{', '.join(KNOWN_HF_CONFIGS)}; 'auto' picks the one named like model.path's last part")
    p.add_argument("--device", choices=[*DEVICES, "cpu"],
                   help="device to plan for (default: cpu when trainer.device=cpu, else h100)")
    p.add_argument("--device-memory", type=float, metavar="GiB", help="memory per device, overriding --device's")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for compute (0.4)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    out.add_argument("--markdown", action="store_true", help="print a Markdown snippet (e.g. for the README)")
    p.add_argument("--out", metavar="FILE", help="write the output to FILE instead of stdout")
    return p


def model_args(cfg: MppoConfig, hf_config: str | None) -> tuple[HFModelArgs, str]:
    """The model's architecture and a name for it: from --hf-config or model.path's config.json."""
    path = cfg.actor_rollout_ref.model.path
    try:
        if hf_config is None:
            if path is None:
                raise ConfigError("actor_rollout_ref.model.path is null: set it to a model directory, or plan with "
                                  f"a built-in config: --hf-config NAME ({', '.join(KNOWN_HF_CONFIGS)})")
            config_json = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
            if not config_json.is_file():
                raise ConfigError(f"no config.json at {path} (actor_rollout_ref.model.path): download the model "
                                  f"first, or plan with a built-in config: --hf-config NAME or --hf-config auto "
                                  f"({', '.join(KNOWN_HF_CONFIGS)})")
            return read_hf_config(config_json), Path(path).name
        if hf_config == "auto":
            if path is None:
                raise ConfigError("--hf-config auto needs actor_rollout_ref.model.path to name the model")
            name, raw = known_config(path)
        else:
            name, raw = known_config(hf_config)
        return read_hf_config(raw), f"{name} (built-in config)"
    except UnsupportedModelError as e:
        raise ConfigError(f"cannot plan {path}: {e}") from None


def plan_config(path: str | None, overrides: list[str], args: argparse.Namespace,
                notes: list[str] | None = None) -> Plan:
    """The plan of one config, checked as `mppo train --dry-run` checks it; its warnings go to `notes`."""
    cfg, warnings = load_checked(path, overrides, planning=True)
    if notes is not None:
        notes.extend(warnings)
    hf_args, name = model_args(cfg, args.hf_config)
    device = args.device or ("cpu" if cfg.trainer.device == "cpu" else "h100")
    memory = int(args.device_memory * GiB) if args.device_memory is not None else None
    try:
        result = plan(cfg, hf_args, memory, device=device, mfu=args.mfu, model_name=name)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    result.source = path or "(defaults)"
    return result


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    paths = [i for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i]
    if args.device_memory is not None and args.device_memory <= 0:
        raise ConfigError(f"--device-memory must be a positive number of GiB, got {args.device_memory:g}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu:g}")
    notes: list[str] = []
    plans = [plan_config(path, overrides, args, notes) for path in (paths or [None])]
    print_warnings(notes)  # once for all the configs
    if args.json:
        text = json.dumps([p.to_dict() for p in plans] if len(plans) > 1 else plans[0].to_dict(), indent=2,
                          default=str)
    elif args.markdown:
        text = render_markdown(plans)
    else:
        text = "\n".join(render_text(p) for p in plans)
    if args.out:
        Path(args.out).write_text(text if text.endswith("\n") else text + "\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0 if all(p.fits for p in plans) else 1
