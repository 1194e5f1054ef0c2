"""Where a config is checked (issue 28): the config on its own in mppo/config (pure: no torch, nothing of this
machine), what it asks of the environment in mppo/preflight.py. Builders and workers trust both, so a ConfigError
is raised nowhere else, but by two commands for their own flags. A new check elsewhere fails here: put it in
mppo.config.validate or mppo.preflight (docs/ARCHITECTURE.md, "Where checks live")."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> why it may raise a ConfigError
PLACES = {
    "mppo/config/loader.py": "the YAML file and the overrides: unknown keys, types, interpolations",
    "mppo/config/validate.py": "the config on its own: choices, ranges, layout, batch arithmetic, config.json facts",
    "mppo/config/validate_async.py": "the separate placement and the off-policy pipeline (called by validate)",
    "mppo/config/lora.py": "LoRA settings (called by validate), and LoRA against the model (by mppo.preflight)",
    "mppo/preflight.py": "what the config asks of this machine and of the files it names",
    "mppo/plan/cli.py": "`mppo plan`'s own flags (--hf-config, --device-memory, --mfu)",
    "mppo/plan/catalog.py": "`mppo plan --hf-config NAME`: a built-in model's name",
    "mppo/doctor.py": "`mppo doctor --timeout`",
}


def _raisers() -> dict[str, list[int]]:
    """module -> lines of every `ConfigError(...)` it constructs."""
    found: dict[str, list[int]] = {}
    for path in sorted((ROOT / "mppo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name == "ConfigError":
                    found.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    return found


def test_config_errors_are_raised_only_where_checks_live():
    raisers = _raisers()
    elsewhere = {module: lines for module, lines in raisers.items() if module not in PLACES}
    assert not elsewhere, f"ConfigError raised outside mppo/config and mppo/preflight.py: {elsewhere}"
    assert sorted(raisers) == sorted(PLACES), f"PLACES names modules that raise none: {set(PLACES) - set(raisers)}"


def test_the_config_package_imports_no_torch():
    """mppo/config is pure: its modules import neither torch nor anything of the machine. Its checks read one thing
    that does, lazily: mppo.core_algos' registries, the one declaration of which estimators, losses and KL
    estimators exist (a second list here would drift from them)."""
    code = ("import sys, pkgutil, importlib, mppo.config\n"
            "for m in pkgutil.iter_modules(mppo.config.__path__): importlib.import_module('mppo.config.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
