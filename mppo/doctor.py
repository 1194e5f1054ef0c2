"""`mppo doctor [CONFIG] [key=value ...] [--json]`: what the installed stack can do on this machine.

Every package is imported in its own subprocess with a timeout (Transformer Engine and SGLang can hang or kill the
interpreter on import when CUDA libraries are missing), so one broken package cannot take the report down. With a
GPU, three few-second self-tests run, each in a subprocess too: an NCCL all-reduce across the local GPUs, a
Transformer Engine RMSNorm+Linear forward against torch, and the Triton fused log-prob kernel against its torch
implementation. With SGLang installed, a real engine round trip runs too, on the GPU or, without one, on SGLang's
CPU tier (start-up, weight push and read-back, generate; 20-60 s): "SGLang rollout: works" means that passed.
Each package and feature gets a verdict line (works / missing package / wrong version / ...) with the fix. Exit code 1 when something the core or the given config needs is broken, else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from mppo.versions import MEGATRON_CORE_PROVEN_ON, MEGATRON_CORE_SUPPORTED

GPU_EXTRA = "pip install mppo[gpu]"
MARK = "MPPO_DOCTOR "  # prefix of the JSON line a probe prints (imports may print other things)


@dataclass(frozen=True)
class Package:
    name: str  # as shown
    module: str  # what `import` is tried
    dists: tuple[str, ...]  # distribution names that may carry its version
    supported: str | None  # PEP 440 specifier mppo supports
    hint: str  # how to install it
    proven_on: str | None = None  # the release mppo's patches of its internals were probed on


PACKAGES = (
    Package("torch", "torch", ("torch",), ">=2.6", "pip install torch (a CUDA build for GPUs: see pytorch.org)"),
    Package("megatron-core", "megatron.core", ("megatron-core", "megatron_core"), MEGATRON_CORE_SUPPORTED,
            f"pip install 'megatron-core{MEGATRON_CORE_SUPPORTED}'", MEGATRON_CORE_PROVEN_ON),
    Package("transformers", "transformers", ("transformers",), ">=4.45", "pip install 'transformers>=4.45'"),
    Package("Transformer Engine", "transformer_engine.pytorch",
            ("transformer-engine", "transformer_engine", "transformer-engine-cu12", "transformer_engine_torch"),
            ">=2.0", GPU_EXTRA),
    Package("SGLang", "sglang", ("sglang",), ">=0.5.23,<0.6", GPU_EXTRA),
    Package("Triton", "triton", ("triton",), None, GPU_EXTRA),
)
CORE = ("torch", "megatron-core", "transformers")


@dataclass
class Check:
    """One verdict line."""

    name: str
    status: str  # works | missing package | wrong version | import fails | no GPU | skipped | failed
    version: str | None = None
    detail: str = ""
    hint: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # torch: CUDA/NCCL/GPU facts; self-tests: measurements

    @property
    def ok(self) -> bool:
        return self.status == "works"


@dataclass
class Report:
    python: str
    packages: list[Check]
    gpus: list[dict[str, Any]]  # name, memory_bytes
    selftests: list[Check]
    needs: dict[str, str] = field(default_factory=dict)  # check name -> why the config needs it
    problems: list[str] = field(default_factory=list)  # needed things that are broken
    config: str | None = None  # the config judged against, if any

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "features": [asdict(f) for f in features(self)], "ok": not self.problems}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Report":
        return Report(data["python"], [Check(**c) for c in data["packages"]], data["gpus"],
                      [Check(**c) for c in data["selftests"]], data["needs"], data["problems"], data.get("config"))


# ------------------------------------------------------------------------------------------------------ probing
_PROBE = r"""
import importlib, importlib.metadata, json, sys


def probe(module, dists):
    out = {"version": None}
    for d in dists:
        try:
            out["version"] = importlib.metadata.version(d)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        missing = e.name in (top, module) and out["version"] is None
        out["error"] = "missing" if missing else f"{type(e).__name__}: {e}"
        return out
    except BaseException as e:  # noqa: BLE001 - anything an import raises is the verdict
        out["error"] = f"{type(e).__name__}: {e}".strip()
        return out
    top = importlib.import_module(module.split(".")[0])
    out["version"] = out["version"] or getattr(top, "__version__", None)
    if module == "torch":
        import torch
        cuda = torch.cuda.is_available()
        out["cuda_build"] = torch.version.cuda
        out["cuda_available"] = cuda
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] if cuda else []
        out["gpus"] = [{"name": p.name, "memory_bytes": p.total_memory} for p in props]
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
        except Exception as e:  # noqa: BLE001
            out["nccl"], out["nccl_error"] = None, str(e)
    return out


print("MPPO_DOCTOR " + json.dumps(probe(sys.argv[1], sys.argv[2].split(","))), flush=True)
"""


def _run_child(args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a Python child; its MARK line as a dict, or {"error": ...} when it hung, crashed or said nothing."""
    try:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s (hangs)"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if lines:
        return json.loads(lines[-1][len(MARK):])
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
    return {"error": f"the interpreter died ({how})" + (f": {tail}" if tail else "")}


def _version_ok(version: str | None, supported: str | None) -> bool:
    if supported is None or version is None:
        return True
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(supported)
    except InvalidVersion:
        return True  # a local build with an odd version string: the import decides


def probe_package(pkg: Package, timeout: float = 120.0) -> Check:
    """Import `pkg` in a subprocess and judge its version against the supported range."""
    res = _run_child(["-c", _PROBE, pkg.module, ",".join(pkg.dists)], timeout)
    version, error = res.get("version"), res.get("error")
    facts = {k: v for k, v in res.items() if k not in ("version", "error")}
    supported = f" (supported {pkg.supported})" if pkg.supported else ""
    if error == "missing":
        return Check(pkg.name, "missing package", None, "not installed" + supported, pkg.hint)
    if not _version_ok(version, pkg.supported):
        return Check(pkg.name, "wrong version", version, f"{version} is outside the supported range {pkg.supported}",
                     f"pip install '{pkg.dists[0]}{pkg.supported}'" if pkg.hint != GPU_EXTRA else pkg.hint, facts)
    if error:
        return Check(pkg.name, "import fails", version, f"import {pkg.module}: {error}", pkg.hint, facts)
    proven = ""
    if pkg.proven_on:  # mppo.parallel.cpu_compat patches its internals on CPU machines
        proven = f"; CPU patches proven on {pkg.proven_on}" + ("" if version == pkg.proven_on else
                                                                f", not on {version}: run make test")
    return Check(pkg.name, "works", version, f"imports{supported}{proven}", None, facts)


# ----------------------------------------------------------------------------------------------- GPU self-tests
def _allreduce_worker(rank: int, world: int, port: int, backend: str, numel: int) -> None:
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x)
    ok = bool(torch.all(x == world * (world + 1) / 2))
    sync()
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(x)
    sync()
    seconds = (time.perf_counter() - start) / 5
    bus_gbps = numel * 4 * 2 * (world - 1) / world / seconds / 1e9  # the ring all-reduce's bus bandwidth
    dist.destroy_process_group()
    if rank == 0:
        print(MARK + json.dumps({"ok": ok, "detail": f"{world} {device.type} rank(s), sum correct: {ok}, "
                                 f"{numel * 4 >> 20} MiB all-reduce {seconds * 1e3:.1f} ms (bus {bus_gbps:.1f} GB/s)"}),
              flush=True)


def _selftest_nccl(backend: str = "nccl", world: int | None = None, numel: int = 1 << 24) -> None:
    """All-reduce 64 MiB of fp32 across the local GPUs (one process each). gloo on CPU runs the same code."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = world or torch.cuda.device_count()
    mp.spawn(_allreduce_worker, args=(world, port, backend, numel), nprocs=world)


def _selftest_te() -> None:
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.LayerNormLinear(256, 512, normalization="RMSNorm", eps=1e-6, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    y = layer(x).float()
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.layer_norm_weight.float()
    ref = torch.nn.functional.linear(normed, layer.weight.float(), layer.bias.float())
    err = float((y - ref).abs().max() / ref.abs().max())
    print(MARK + json.dumps({"ok": err < 2e-2, "detail": f"RMSNorm+Linear bf16 forward, relative error {err:.1e} "
                             "vs torch"}), flush=True)


def _selftest_triton(device: str = "cuda", rows: int = 512, vocab: int = 4096) -> None:
    """The Triton fused log-prob + entropy kernel against its torch implementation, forward and backward.
    (On CPU it runs under TRITON_INTERPRET=1 only, which is how the tests exercise this function.)"""
    import torch

    from mppo.kernels import fused_linear_logprob_entropy

    torch.manual_seed(0)
    hidden = torch.randn(rows, 256, device=device, requires_grad=True)
    weight = (0.05 * torch.randn(vocab, 256, device=device)).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=device)
    results = []
    for backend in ("triton", "torch"):
        lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, backend=backend)
        gh, gw = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), (hidden, weight))
        results.append((lp, ent, gh, gw))
    err = max(float((a - b).detach().abs().max()) for a, b in zip(*results))
    print(MARK + json.dumps({"ok": err < 1e-3, "detail": f"fused log-prob + entropy fwd/bwd, max |triton - torch| "
                             f"= {err:.1e}"}), flush=True)


def _selftest_sglang() -> None:
    """A real SGLang engine round trip through mppo's adapter: start it (on the GPU, or SGLang's CPU tier without
    one), push a random tiny Llama's weights, read one back (bitwise), generate greedily and compare the returned
    log-probs with an HF recompute, push changed weights and read them back again."""
    import tempfile
    import time
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mppo.rollout.base import SamplingParams
    from mppo.rollout.sglang_engine import SGLangRolloutEngine

    on_cpu = not torch.cuda.is_available()
    dtype = torch.float32 if on_cpu else torch.bfloat16
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    name, prompt = "model.layers.1.mlp.down_proj.weight", [1, 2, 3, 4, 5]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # SGLang reads the config; the weights arrive by update_weights
        start = time.perf_counter()
        engine = SGLangRolloutEngine(tmp, gpu_memory_utilization=0.2, dtype=str(dtype).split(".")[1], on_cpu=on_cpu,
                                     max_total_tokens=2048 if on_cpu else None, log_path=Path(tmp) / "sglang.log",
                                     name="mppo doctor's test engine")
        started = time.perf_counter() - start
        try:
            engine.update_weights([list(model.state_dict().items())])
            same = torch.equal(engine.get_weight(name), model.state_dict()[name].float())
            out = engine.generate([prompt], SamplingParams(do_sample=False, max_new_tokens=8), step=0)[0]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
            error = float((ref - torch.tensor(out.log_probs)).abs().max())
            with torch.no_grad():
                model.get_parameter(name).mul_(-1.0)
            engine.release()
            engine.update_weights([list(model.state_dict().items())])
            engine.resume()
            same = same and torch.equal(engine.get_weight(name), model.state_dict()[name].float())
        finally:
            engine.shutdown()
    tolerance = 1e-4 if on_cpu else 5e-2
    where = "SGLang's CPU tier" if on_cpu else "GPU"
    print(MARK + json.dumps({"ok": same and error < tolerance, "detail": (
        f"{where}: started in {started:.0f} s, weights pushed and read back {'bitwise' if same else 'DIFFERENT'} "
        f"(twice), greedy generate log-probs vs HF {error:.1e}")}), flush=True)


SELFTESTS = {"NCCL all-reduce": "_selftest_nccl", "Transformer Engine layer": "_selftest_te",
             "Triton fused log-prob": "_selftest_triton", "SGLang round trip": "_selftest_sglang"}
SELFTEST_NEEDS = {"NCCL all-reduce": "torch", "Transformer Engine layer": "Transformer Engine",
                  "Triton fused log-prob": "Triton", "SGLang round trip": "SGLang"}
# Self-tests that also run without a GPU (SGLang's CPU tier), and their own time limits (an engine start-up).
RUNS_WITHOUT_GPU = ("SGLang round trip",)
MIN_TIMEOUT_S = {"SGLang round trip": 600.0}


def run_selftests(packages: list[Check], timeout: float) -> list[Check]:
    cuda = next(c for c in packages if c.name == "torch").facts.get("cuda_available")
    out = []
    for name, func in SELFTESTS.items():
        if not cuda and name not in RUNS_WITHOUT_GPU:
            out.append(Check(name, "no GPU", detail="skipped (needs a GPU)"))
            continue
        needed = next(c for c in packages if c.name == SELFTEST_NEEDS[name])
        if not needed.ok:
            out.append(Check(name, "skipped", detail=f"{needed.name}: {needed.status}", hint=needed.hint))
            continue
        env = {"TRITON_INTERPRET": "0"}  # on a GPU the kernels must compile, not be interpreted
        res = _run_child(["-c", f"import mppo.doctor as d; d.{func}()"], max(timeout, MIN_TIMEOUT_S.get(name, 0)),
                         env)
        status = "works" if res.get("ok") else "failed"
        out.append(Check(name, status, detail=res.get("detail") or res.get("error", ""), facts=res))
    return out


# -------------------------------------------------------------------------------------------------- the report
def collect(timeout: float = 120.0) -> Report:
    """Probe every package (in parallel subprocesses) and, with a GPU, run the self-tests."""
    with ThreadPoolExecutor(max_workers=len(PACKAGES)) as pool:
        packages = list(pool.map(lambda p: probe_package(p, timeout), PACKAGES))
    torch_check = packages[0]
    if torch_check.ok and not torch_check.facts.get("cuda_build"):
        torch_check.detail += "; CPU-only build: no CUDA, no NCCL (GPU runs need a CUDA build of torch)"
    gpus = torch_check.facts.get("gpus", [])
    return Report(f"{platform.python_version()} ({sys.executable})", packages, gpus,
                  run_selftests(packages, timeout))


def config_needs(cfg: Any) -> dict[str, str]:
    """Which checks a run of `cfg` depends on (check name -> the config key that asks for it)."""
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    needs = {name: "mppo itself" for name in CORE}
    if trainer.device == "cuda":
        needs["GPU"] = f"trainer.device=cuda with {trainer.n_gpus_per_node} GPUs per node"
        needs["NCCL all-reduce"] = "trainer.device=cuda"
    if arr.rollout.name == "sglang":
        needs["SGLang"] = needs["SGLang round trip"] = "actor_rollout_ref.rollout.name=sglang"
    if arr.model.transformer_impl == "te":
        needs["Transformer Engine"] = "actor_rollout_ref.model.transformer_impl=te"
    backend = arr.actor.kernel_backend
    if backend == "triton" or (backend == "auto" and trainer.device == "cuda"):
        needs["Triton"] = f"actor_rollout_ref.actor.kernel_backend={backend} on cuda"
    return needs


def judge(report: Report, needs: dict[str, str], gpus_needed: int = 0) -> Report:
    """Fill report.needs / report.problems: each needed check that is not working, with why it is needed."""
    report.needs, report.problems = dict(needs), []
    checks = {c.name: c for c in [*report.packages, *report.selftests]}
    for name, why in needs.items():
        if name == "GPU":
            if len(report.gpus) < gpus_needed:
                report.problems.append(f"{why}, but {len(report.gpus)} GPU(s) are visible")
        elif name in checks and checks[name].status not in ("works", "no GPU"):
            report.problems.append(f"{name} ({why}): {checks[name].status}: {checks[name].detail}")
    return report


def features(report: Report) -> list[Check]:
    """What a user can run, one line each, from the package checks and the self-tests."""
    c = {x.name: x for x in [*report.packages, *report.selftests]}
    facts = c["torch"].facts
    broken = [n for n in CORE if not c[n].ok]
    out = [Check("CPU training, demo and tests (gloo)", "broken" if broken else "works",
                 detail=f"needs {', '.join(broken)}" if broken else "torch + megatron-core + transformers import",
                 hint=c[broken[0]].hint if broken else None)]
    if not c["torch"].ok:
        no_gpu = f"unavailable: torch {c['torch'].status}"
        out.append(Check("GPU training (NCCL)", "unavailable", detail=f"torch: {c['torch'].status}",
                         hint=c["torch"].hint))
    elif not facts.get("cuda_build"):
        no_gpu = "unavailable: CPU-only build of torch"
        out.append(Check("GPU training (NCCL)", "unavailable", detail="CPU-only build of torch",
                         hint="install a CUDA build of torch (pytorch.org), then pip install mppo[gpu]"))
    elif not facts.get("cuda_available"):
        no_gpu = "unavailable: no GPU visible"
        out.append(Check("GPU training (NCCL)", "unavailable", detail="no GPU visible (CUDA_VISIBLE_DEVICES, driver)"))
    else:
        no_gpu = ""
        out.append(_from_selftest("GPU training (NCCL)", c["NCCL all-reduce"]))
    for feature, package, test, fallback in (
            ("Transformer Engine layers", "Transformer Engine", "Transformer Engine layer",
             "megatron-core's local layers with SDPA attention are used (model.transformer_impl=sdpa)"),
            ("SGLang rollout", "SGLang", "SGLang round trip", "rollout.name=cpu runs without it (tests, demo)"),
            ("Triton kernels on GPU", "Triton", "Triton fused log-prob",
             "kernel_backend=torch runs everywhere; on CPU Triton runs only under TRITON_INTERPRET=1")):
        pkg = c[package]
        if not pkg.ok:
            out.append(Check(feature, "unavailable", detail=f"{package}: {pkg.status}; {fallback}", hint=pkg.hint))
        elif test in RUNS_WITHOUT_GPU:
            out.append(_from_selftest(feature, c[test]))
        elif no_gpu:
            out.append(Check(feature, "unavailable", detail=f"{no_gpu.split(': ')[1]}; {fallback}"))
        else:
            out.append(_from_selftest(feature, c[test]))
    return out


def _from_selftest(feature: str, test: Check) -> Check:
    return Check(feature, "works" if test.ok else "broken", detail=f"self-test {test.status}: {test.detail}",
                 hint=test.hint)


def render_text(report: Report) -> str:
    lines = [f"mppo doctor — python {report.python}"]
    for c in report.packages:
        needed = "  [needed]" if c.name in report.needs else ""
        lines.append(f"  {c.name:<20} {c.version or '-':<16} {c.status}: {c.detail}{needed}"
                     + (f"\n  {'':<37} fix: {c.hint}" if c.hint and not c.ok else ""))
    facts = report.packages[0].facts
    cuda = ("available" if facts.get("cuda_available") else "no GPU: GPU self-tests skipped") if facts else \
        "unknown: torch does not import"
    lines.append(f"  {'CUDA':<20} {facts.get('cuda_build') or '-':<16} {cuda}")
    lines.append(f"  {'NCCL':<20} {facts.get('nccl') or '-':<16} "
                 + ("bundled with torch" if facts.get("nccl") else "not available (CPU build of torch or no CUDA)"))
    gpus = ", ".join(f"{g['name']} {g['memory_bytes'] / (1 << 30):.0f} GiB" for g in report.gpus)
    lines.append(f"GPUs: {len(report.gpus)}" + (f" ({gpus})" if gpus else ""))
    lines.append("self-tests:")
    for c in report.selftests:
        lines.append(f"  {c.name:<26} {c.status}: {c.detail}" + (f" (fix: {c.hint})" if c.hint else ""))
    lines.append("features:")
    for c in features(report):
        lines.append(f"  {c.name:<36} {c.status}: {c.detail}" + (f"\n  {'':<36} fix: {c.hint}" if c.hint else ""))
    if report.problems:
        lines.append("verdict: BROKEN for this run:")
        lines += [f"  - {p}" for p in report.problems]
    else:
        lines.append(f"verdict: OK for {report.config}" if report.config else
                     "verdict: OK (core packages work; GPU features as listed above; pass a config to check "
                     "what it needs)")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mppo doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("items", nargs="*", metavar="[CONFIG.yaml] key=value",
                        help="optional config (and overrides): judge what that run needs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per import / self-test (120)")
    args = parser.parse_intermixed_args(argv)
    if args.timeout <= 0:
        from mppo.config import ConfigError

        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    needs, gpus_needed = {name: "mppo itself" for name in CORE}, 0
    if args.items:
        from mppo.config import load_config

        path = args.items[0] if "=" not in args.items[0] else None
        cfg = load_config(path, [i for i in args.items if i is not path])
        needs = config_needs(cfg)
        gpus_needed = cfg.trainer.n_gpus_per_node if cfg.trainer.device == "cuda" else 0
    report = judge(collect(args.timeout), needs, gpus_needed)
    report.config = " ".join(args.items) or None
    sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n" if args.json else render_text(report))
    return 1 if report.problems else 0
