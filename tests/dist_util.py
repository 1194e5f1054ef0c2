"""Launch test ranks (`launch`: a script or `-m mppo ...` on N local ranks, as torchrun would), run a test script
on them and collect what each rank reports (`run_torchrun`, the pytest side), and the rank side of such a script
(`rank_main`).

A rank pays ~8 s of torch + megatron-core imports, a trainer rank ~4 s more. `launch` forks its ranks from a server
that imported them once per pytest process (multiprocessing's forkserver with those modules preloaded; nothing has
run in it, so nothing is shared but imported code), so a launch costs its work, not its imports. The real torchrun
path stays covered where it is the subject: the CLI, multi-node, stall and demo tests and the first launch of the
kill/resume chain launch `torchrun` itself.
One launch should still check many cases: the script runs them all and writes one JSON file per rank.
"""
from __future__ import annotations

import argparse
import gc
import importlib.machinery
import json
import multiprocessing
import multiprocessing.connection
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
# What the ranks import before their first line of work: torch and megatron-core, then what a trainer rank imports
# on top (transformers' tokenizers and the HF models of the tests' tiny checkpoints, mppo's trainer, workers and
# CPU engine, matplotlib for the run's plot): ~8 s, then ~4 s more of CPU per rank, paid once per pytest process.
# Anything whose import reads the environment differently per launch must not be here (the server imports it
# once, with pytest's environment; mppo reads its variables when it runs, not at import).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.distributed", "megatron.core.pipeline_parallel",
           "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "mppo.cli", "mppo.trainer.fit", "mppo.workers.actor", "mppo.workers.critic", "mppo.workers.reference",
           "mppo.rollout.factory", "mppo.rollout.cpu_engine", "matplotlib.figure", "matplotlib.backends.backend_agg"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """One rank, in a process forked from the server: torchrun's environment, stdout and stderr to `log`.out and
    .err, then argv run as `python argv...` would (a script path, or -m and a module)."""
    gc.freeze()  # the server's imports live as long as the rank: the collector need not walk them (Python's gc docs)
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        script = Path(argv[0]).resolve()
        sys.path.insert(0, str(script.parent))
        # The script is the main module, as under runpy.run_path, but with a module spec named "__main__": the
        # processes the rank spawns (SGLang's scheduler and detokenizer) then skip importing it again first
        # (multiprocessing.spawn, as for `python -m pkg`), ~4 s of torch each; so nothing the script defines can be
        # sent to such a process (none is: object collectives between ranks are fine).
        main = types.ModuleType("__main__")
        main.__file__ = str(script)
        main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
        sys.modules["__main__"] = main
        exec(compile(script.read_bytes(), str(script), "exec", dont_inherit=True), main.__dict__)


def launch(nproc: int, argv: list[str], env: dict[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python argv...` on `nproc` local ranks with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...),
    from REPO, and return the ranks' stdout and stderr (each in rank order) and the first failing rank's exit code
    (`exit_codes`: every rank's).

    Like torchrun, a failing rank ends the others (after a 10 s grace for them to report); past `timeout` all are
    killed and the output so far is in the raised TimeoutError.
    """
    forkserver = multiprocessing.get_context("forkserver")  # one server per process, started by the first launch
    forkserver.set_forkserver_preload(PRELOAD)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "NODE_RANK": "0", "TORCHELASTIC_RUN_ID": "test", **(env or {})}
    logs = tempfile.mkdtemp(prefix="ranks-")
    ranks = []
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
        proc = forkserver.Process(target=_rank, args=(argv, rank_env, f"{logs}/rank{rank}"), daemon=False)
        proc.start()
        ranks.append(proc)

    def output(suffix: str) -> str:
        files = [Path(f"{logs}/rank{r}{suffix}") for r in range(nproc)]
        return "".join(f.read_text(errors="replace") for f in files if f.exists())

    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any(p.exitcode is None for p in ranks):
            multiprocessing.connection.wait([p.sentinel for p in ranks if p.exitcode is None], timeout=1)
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in ranks):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + 10):
                for p in ranks:
                    p.kill()
                for p in ranks:
                    p.join()
                if now > deadline:
                    raise TimeoutError(f"{argv} on {nproc} ranks ran past {timeout:.0f} s:\n"
                                       f"{output('.out')[-4000:]}\n{output('.err')[-8000:]}")
        done = subprocess.CompletedProcess(argv, next((p.exitcode for p in ranks if p.exitcode != 0), 0),
                                           output(".out"), output(".err"))
        done.exit_codes = [p.exitcode for p in ranks]  # every rank's, in rank order (-9: SIGKILL)
        return done
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def train_cli(world: int, overrides: list[str], env: dict[str, str] | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=world -m mppo train configs/demo_cpu.yaml overrides...` (through `launch`),
    failing with the ranks' output when it does not end cleanly."""
    proc = launch(world, ["-m", "mppo", "train", "configs/demo_cpu.yaml", *overrides], env=env, timeout=timeout)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def run_torchrun(script: str | Path, nproc: int, out_dir: Path, args: list[str] | None = None,
                 timeout: float = 600, env: dict | None = None) -> list[dict]:
    """Launch `script` on `nproc` local ranks (`launch`); return the JSON each rank wrote to out_dir/rank{R}.json.

    The script receives `--out DIR` as its first argument. On failure the ranks' output is in the assertion.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = launch(nproc, [str(script), "--out", str(out_dir), *(args or [])], env=env, timeout=timeout)
    assert proc.returncode == 0, f"ranks failed ({proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_cases(script: str | Path, nproc: int, out_dir: Path, **kwargs) -> list[dict]:
    """run_torchrun for a script built on `rank_main`: every rank's results, failing on a rank's crash traceback."""
    results = run_torchrun(script, nproc, out_dir, **kwargs)
    for r in results:
        assert "crash" not in r, r["crash"]
    return results


def on_every_rank(ranks: list[dict], key: str) -> list:
    """`key`'s value on every rank, failing with the ranks that did not report it."""
    missing = [i for i, r in enumerate(ranks) if key not in r]
    assert not missing, f"{key} missing on ranks {missing}"
    return [r[key] for r in ranks]


def rank_main(run: Callable[[argparse.Namespace, dict], None], *,
              add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
              process_group: bool = True) -> None:
    """The main() of a tests/dist script under run_torchrun: parse `--out DIR` (and what `add_arguments` adds),
    make the process group (`process_group`; destroyed layouts are rebuilt per case), call `run(options, results)`
    and write `results` to DIR/rank{RANK}.json, with the traceback under "crash" when `run` raised."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    if add_arguments is not None:
        add_arguments(parser)
    opts = parser.parse_args()
    rank = int(os.environ["RANK"])
    res: dict = {}
    if process_group:
        from mppo.parallel import destroy, init_distributed

        init_distributed(1, 1)  # the process group; each case builds (and destroys) its own layout
        destroy()
    gc.freeze()  # the imports outlive every case: each case's teardown (mppo.parallel.destroy) need not walk them
    try:
        run(opts, res)
    except Exception:
        res["crash"] = traceback.format_exc()
        raise
    finally:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / f"rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))


def hf_response_log_softmax(batch: dict, model, temperature: float):
    """log_softmax [B, T, V] of an HF model's logits at the positions that predict each response token of a trainer
    batch (prompt left-padded to `prompt_mask`'s width, response after it): the independent reference the trainer
    tests compare log-probs, entropies and sum_v p_v^2 against."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float() / temperature
    prompt_len, response_len = batch["prompt_mask"].shape[1], batch["responses"].shape[1]
    return torch.log_softmax(logits[:, prompt_len - 1: prompt_len - 1 + response_len], dim=-1)
