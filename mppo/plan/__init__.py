"""`mppo plan`: per-GPU memory, fit verdict, knobs to turn and step-time estimate of a config, before any GPU hour.

Modules: catalog (built-in HF configs, device data), memory (model state, activations, log-prob working set,
rollout engine), timing (FLOPs and bandwidth), planner (`plan(cfg, hf_args, device_memory_bytes) -> Plan`,
suggestions), render (text, Markdown), cli (`main(argv)`).
"""
from __future__ import annotations

from mppo.plan.catalog import DEVICES, KNOWN_HF_CONFIGS, DeviceSpec, known_config
from mppo.plan.cli import main, model_args
from mppo.plan.memory import PlanError
from mppo.plan.planner import Plan, plan
from mppo.plan.render import render_markdown, render_text

__all__ = ["DEVICES", "KNOWN_HF_CONFIGS", "DeviceSpec", "Plan", "PlanError", "known_config", "main", "model_args",
           "plan", "render_markdown", "render_text"]
