"""Runs at start-up in every Python process SGLang spawns on the CPU (this directory is first on their PYTHONPATH,
see mppo.rollout.sglang_cpu): defines torchvision's op schemas before anything imports torchvision, makes SGLang's
host buffers unpinned (mppo_unpinned_host_memory), then runs the sitecustomize this one shadows, if the interpreter
has one."""
import importlib.util
import os
import sys

import mppo_torchvision_op_schemas

mppo_torchvision_op_schemas.define()

import mppo_unpinned_host_memory  # noqa: E402

mppo_unpinned_host_memory.install()

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(_entry or os.getcwd(), "sitecustomize.py")
    if os.path.abspath(_entry or os.getcwd()) != _here and os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_mppo_shadowed_sitecustomize", _candidate)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
