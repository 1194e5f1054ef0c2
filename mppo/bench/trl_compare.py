"""`mppo bench trl-compare`: GRPO with mppo, then with TRL's GRPOTrainer, on the same inputs, in one command.

Same random Qwen2 model directory, same prompts in the same order (no shuffling), same group size, response
length, sampling (temperature 1, no top-k/top-p), optimizer (AdamW, constant LR, no weight decay, grad-norm clip
1), loss (clipped ratio 0.2, token-mean over the step's batch = TRL's "dapo"), advantages (group mean and std),
one optimizer step per generation, no KL (TRL's default beta=0), and the same reward function
(mppo.bench._trl_grpo: a toy digit-count reward that a random tiny model can learn in a few steps).

TRL runs in its own virtualenv, made by this command on first use (`python -m venv`, then
`pip install -c constraints-cpu.txt trl`, which keeps torch on the CPU wheel; the command refuses a venv whose
torch is not the CPU build). Tokens per second = (prompt + response tokens) / wall seconds of the training steps,
model loading excluded on both sides; the first step is reported separately (warm-up). Tokens per CPU-second
divide by the CPU time of the trainer's processes instead (all ranks, all threads), which other jobs on the
machine disturb far less than wall time.

Each step is also split into generation (mppo: the rollout phase, engine.generate plus scoring on the engine's
rank; TRL: the time inside transformers' `generate`) and update (the rest of the step: weight sync, scoring,
advantages, forward/backward, optimizer), reported as response tokens per generation second and prompt +
response tokens per update second. `--fixed-length` makes every response exactly `--response-length` tokens on
both sides (mppo `rollout.ignore_eos=true`, TRL `min_new_tokens`), so the two process the same tokens; it uses a
plain random model (no raised EOS probability). The issue's setting (~1M parameters, 8 prompts x 8 samples x 64
tokens): `mppo bench trl-compare --fixed-length --hidden 128 --group 8`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mppo.bench import step as bench_step

TRL_SCRIPT = Path(__file__).with_name("_trl_grpo.py")
CONSTRAINTS = bench_step.REPO / "constraints-cpu.txt"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench trl-compare", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="key=value", help="extra mppo config overrides (applied last)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO group)")
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--fixed-length", action="store_true",
                   help="every response exactly --response-length tokens (mppo: rollout.ignore_eos; TRL: "
                        "min_new_tokens), on a plain random model (no raised EOS probability)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="mppo ranks (1 thread each when nproc = cores)")
    p.add_argument("--tp", type=int, default=1, help="mppo tensor parallelism (nproc / tp = DP)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per mppo rank (0: cores / nproc); TRL gets nproc x threads: the same cores")
    p.add_argument("--seeds", default="1,2,3", help="comma list; each seed runs mppo then TRL (mppo: trainer.seed)")
    p.add_argument("--last", type=int, default=3, help="reward compared as the mean over the last N steps")
    p.add_argument("--venv", type=Path, default=bench_step.CACHE / "trl-venv", help="TRL's virtualenv")
    p.add_argument("--trl-version", default="", help="pip requirement suffix for trl, e.g. ==1.16.0")
    p.add_argument("--skip-trl", action="store_true", help="run mppo only (no venv, no TRL)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None, help="reward and tokens/s per step, both trainers")
    return p


# ------------------------------------------------------------------------------------------------ TRL venv
def ensure_trl_venv(venv: Path, trl_requirement: str) -> dict[str, str]:
    """Create the venv with TRL (torch pinned to the CPU wheel) unless it exists; return its package versions."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating TRL's virtualenv in {venv} (one-time)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), f"trl{trl_requirement}"],
                       check=True)
    listing = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                             text=True).stdout
    versions = {p["name"].lower(): p["version"] for p in json.loads(listing)}
    torch_version = versions.get("torch", "")
    if not torch_version.endswith("+cpu"):
        raise RuntimeError(f"{venv} has torch {torch_version or '(none)'}, not the CPU wheel: remove the venv and "
                           f"rerun (pip install -c {CONSTRAINTS} pins torch to the CPU build)")
    if "trl" not in versions:
        raise RuntimeError(f"{venv} has no trl; remove it and rerun")
    return {k: versions[k] for k in ("trl", "transformers", "torch", "accelerate", "datasets") if k in versions}


# ------------------------------------------------------------------------------------------------ the two runs
def mppo_spec(opts: argparse.Namespace, assets: Path, run_dir: Path, seed: int) -> dict[str, Any]:
    from mppo.bench.assets import bench_overrides

    overrides = bench_overrides(assets, run_dir, world=opts.nproc, batch=opts.prompts_per_step,
                                response_length=opts.response_length, estimator="grpo", n=opts.group)
    overrides += [
        "data.shuffle=false", f"trainer.seed={seed}", f"reward.custom_fn.path={TRL_SCRIPT}",
        "reward.custom_fn.name=compute_score",
        "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
        "algorithm.norm_adv_by_std_in_grpo=true", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.clip_ratio=0.2", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={opts.prompts_per_step}", "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.optim.lr={opts.lr}", "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.optim.clip_grad=1.0", "actor_rollout_ref.actor.optim.lr_scheduler=constant",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={opts.tp}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
        f"actor_rollout_ref.rollout.ignore_eos={str(opts.fixed_length).lower()}",
    ] + list(opts.overrides)
    return {"config": str(bench_step.DEFAULT_CONFIG), "overrides": overrides, "warmup": 0, "steps": opts.steps,
            "repeats": 1}


def run_mppo(opts: argparse.Namespace, assets: Path, work: Path, seed: int) -> dict[str, Any]:
    threads = mppo_threads(opts)
    result = bench_step.launch(mppo_spec(opts, assets, work / "run", seed), opts.nproc, threads, work)
    samples = opts.prompts_per_step * opts.group
    steps = [{"seconds": s["seconds"]["step"], "cpu_seconds": s["cpu_seconds"], "tokens": s["tokens"],
              "generation_seconds": s["seconds"]["gen"], "response_tokens": s["response_length"] * samples,
              "reward": s["score"],
              "response_length": s["response_length"], "grad_norm": s["actor"].get("actor/grad_norm"),
              "lr": s["actor"].get("actor/lr"), "entropy": s["actor"].get("actor/entropy")}
             for s in result["steps"]]
    return {"steps": steps, "threads_per_rank": threads, "layout": result["layout"], "load": result["load"]}


def mppo_threads(opts: argparse.Namespace) -> int:
    return opts.threads or max(1, bench_step.cpu_cores() // opts.nproc)


def run_trl(opts: argparse.Namespace, assets: Path, work: Path, prompts: list[str], seed: int) -> dict[str, Any]:
    prompts_file, out = work / "prompts.json", work / "trl.json"
    prompts_file.write_text(json.dumps(prompts))
    # -P: the script's directory (mppo/bench, which holds kernels.py) must not shadow the `kernels` package that
    # transformers probes for; that module imports mppo, which TRL's venv does not have
    cmd = [str(opts.venv / "bin" / "python"), "-P", str(TRL_SCRIPT), "--model", str(assets / "model"), "--prompts",
           str(prompts_file), "--out", str(out), "--steps", str(opts.steps), "--prompts-per-step",
           str(opts.prompts_per_step), "--group", str(opts.group), "--response-length", str(opts.response_length),
           "--lr", str(opts.lr), "--seed", str(seed), "--workdir", str(work / "trl-out"),
           "--threads", str(opts.nproc * mppo_threads(opts))] + (["--fixed-length"] if opts.fixed_length else [])
    before = bench_step.load_average()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"TRL run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["load"] = {"before": before, "after": bench_step.load_average()}
    samples = opts.prompts_per_step * opts.group
    result["steps"] = [{"seconds": s["seconds"], "cpu_seconds": s.get("cpu_seconds"), "tokens": s["tokens"],
                        "generation_seconds": s["generation_seconds"],
                        "response_tokens": s["completions/mean_length"] * samples,
                        "reward": s["reward"],
                        "response_length": s.get("completions/mean_length"), "grad_norm": s.get("grad_norm"),
                        "lr": s.get("learning_rate"), "entropy": s.get("entropy")} for s in result["steps"]]
    return result


def training_prompts(assets: Path, count: int) -> list[str]:
    """The first `count` training prompts in file order, as mppo renders them (countdown's base template opens
    the assistant turn itself, so no chat template), for TRL's "standard" (plain text) prompt format."""
    from mppo.data import RLDataset, load_tokenizer

    dataset = RLDataset(str(assets / "data" / "train.parquet"), load_tokenizer(assets / "model"),
                        max_prompt_length=512)
    if count > len(dataset):
        raise ValueError(f"{count} prompts needed but the bench data has {len(dataset)}")
    return [dataset[i].raw_prompt for i in range(count)]


# ------------------------------------------------------------------------------------------------ report
def side_summary(runs: list[list[dict[str, Any]]], last: int) -> dict[str, float]:
    """One trainer over its runs (one per seed): tokens/s pooled over the runs' steps after the first; rewards
    averaged over runs, with the spread of the last-steps reward across runs."""
    after_first = [s for steps in runs for s in (steps[1:] or steps)]
    every = [s for steps in runs for s in steps]
    lasts = [statistics.mean(s["reward"] for s in steps[-last:]) for steps in runs]
    generation_s = sum(s["generation_seconds"] for s in after_first)
    update_s = sum(s["seconds"] - s["generation_seconds"] for s in after_first)
    return {
        "tokens_per_s": sum(s["tokens"] for s in after_first) / sum(s["seconds"] for s in after_first),
        # generation: response tokens per second of generation; update: everything else in the step (weight
        # sync, scoring, advantages, forward/backward, optimizer), prompt + response tokens per second
        "generation_tokens_per_s": sum(s["response_tokens"] for s in after_first) / generation_s,
        "update_tokens_per_s": sum(s["tokens"] for s in after_first) / update_s,
        "median_generation_s": statistics.median(s["generation_seconds"] for s in after_first),
        "median_update_s": statistics.median(s["seconds"] - s["generation_seconds"] for s in after_first),
        "tokens_per_s_all": sum(s["tokens"] for s in every) / sum(s["seconds"] for s in every),
        # CPU time summed over the trainer's processes/threads: what other jobs on the machine disturb least
        "tokens_per_cpu_s": (sum(s["tokens"] for s in after_first) / sum(s["cpu_seconds"] for s in after_first)
                             if all(s.get("cpu_seconds") for s in after_first) else float("nan")),
        "first_step_s": statistics.median(steps[0]["seconds"] for steps in runs),
        "median_step_s": statistics.median(s["seconds"] for s in after_first),
        "reward_first": statistics.mean(steps[0]["reward"] for steps in runs),
        "reward_final": statistics.mean(steps[-1]["reward"] for steps in runs),
        "reward_last": statistics.mean(lasts), "reward_last_min": min(lasts), "reward_last_max": max(lasts),
        "response_length": statistics.mean(s["response_length"] for s in every if s["response_length"] is not None),
    }


def render(mppo: dict[str, float], trl: dict[str, float] | None, last: int) -> str:
    rows = (("tokens/s, steps 2.. (prompt + response)", "tokens_per_s", "{:.0f}"),
            ("  generation: response tokens/s", "generation_tokens_per_s", "{:.0f}"),
            ("  update (rest of step): tokens/s", "update_tokens_per_s", "{:.0f}"),
            ("tokens/s, all steps", "tokens_per_s_all", "{:.0f}"),
            ("tokens per CPU-second, steps 2..", "tokens_per_cpu_s", "{:.0f}"),
            ("median step seconds (steps 2..)", "median_step_s", "{:.2f}"),
            ("  generation", "median_generation_s", "{:.2f}"),
            ("  update (rest of step)", "median_update_s", "{:.2f}"),
            ("first step seconds", "first_step_s", "{:.2f}"),
            ("mean response length", "response_length", "{:.1f}"),
            ("reward, step 1", "reward_first", "{:.3f}"),
            ("reward, last step", "reward_final", "{:.3f}"),
            (f"reward, mean of last {last} steps", "reward_last", "{:.3f}"),
            ("  lowest run", "reward_last_min", "{:.3f}"), ("  highest run", "reward_last_max", "{:.3f}"))
    head = f"{'':<42}{'mppo':>12}{'TRL':>12}{'mppo / TRL':>12}"
    lines = [head, "-" * len(head)]
    for label, key, fmt in rows:
        line = f"{label:<42}{fmt.format(mppo[key]):>12}"
        if trl is not None:
            line += f"{fmt.format(trl[key]):>12}"
            if "tokens_per" in key and trl[key]:
                line += f"{mppo[key] / trl[key]:>11.2f}x"
        lines.append(line)
    return "\n".join(lines)


def plot(path: Path, sides: dict[str, list[list[dict[str, Any]]]]) -> None:
    """Reward per step (each run thin, the mean over runs bold) and tokens/s per step, per trainer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(9, 3.2))
    for color, (name, runs) in zip(("tab:blue", "tab:orange"), sides.items()):
        steps = min(len(r) for r in runs)
        x = range(1, steps + 1)
        for run in runs:
            ax_r.plot(x, [s["reward"] for s in run[:steps]], color=color, alpha=0.3, linewidth=0.8)
            ax_t.plot(x, [s["tokens"] / s["seconds"] for s in run[:steps]], color=color, alpha=0.5, marker="o",
                      markersize=2, linewidth=0.8)
        ax_r.plot(x, [statistics.mean(r[i]["reward"] for r in runs) for i in range(steps)], color=color,
                  linewidth=2, label=f"{name} (mean of {len(runs)} seeds)")
    ax_r.set(title="mean reward per step", xlabel="step")
    ax_t.set(title="tokens/s per step", xlabel="step", yscale="log")
    ax_r.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    if min(opts.steps, opts.prompts_per_step, opts.group, opts.response_length, opts.nproc, opts.last) < 1:
        print("mppo bench trl-compare: --steps, --prompts-per-step, --group, --response-length, --nproc and --last "
              "must be >= 1", file=sys.stderr)
        return 2
    eos_prob = 0.0 if opts.fixed_length else min(0.5, 2.0 / opts.response_length)
    assets = bench_step.bench_assets(opts.hidden, opts.layers, eos_prob)
    versions = {} if opts.skip_trl else ensure_trl_venv(opts.venv, opts.trl_version)
    prompts = training_prompts(assets, opts.steps * opts.prompts_per_step)
    seeds = [int(x) for x in opts.seeds.split(",") if x.strip()]
    mppo_runs, trl_runs = [], []
    with tempfile.TemporaryDirectory(prefix="mppo-trl-compare-") as tmp:
        for seed in seeds:  # mppo then TRL, seed after seed: both sides see the same drift in machine load
            work = Path(tmp) / f"seed{seed}"
            (work / "mppo").mkdir(parents=True)
            (work / "trl").mkdir()
            mppo_runs.append(run_mppo(opts, assets, work / "mppo", seed))
            if not opts.skip_trl:
                trl_runs.append(run_trl(opts, assets, work / "trl", prompts, seed))
    if trl_runs:
        from mppo.data import load_tokenizer

        ours = load_tokenizer(assets / "model")(prompts[0], add_special_tokens=False)["input_ids"]
        if list(ours) != trl_runs[0]["first_prompt_ids"]:
            raise RuntimeError("TRL tokenized the first prompt differently from mppo; the runs are not comparable")
    mppo_sum = side_summary([r["steps"] for r in mppo_runs], opts.last)
    trl_sum = side_summary([r["steps"] for r in trl_runs], opts.last) if trl_runs else None
    mppo, trl = mppo_runs[0], (trl_runs[0] if trl_runs else None)
    layout = mppo["layout"]
    print(f"mppo bench trl-compare: GRPO, random Qwen2 (hidden {opts.hidden}, {opts.layers} layers, fp32), "
          f"{opts.steps} steps x {opts.prompts_per_step} prompts x {opts.group} samples, responses "
          f"{'of exactly' if opts.fixed_length else '<='} {opts.response_length} tokens, lr {opts.lr}, toy digit "
          f"reward, seeds {seeds} (mppo then TRL per seed)")
    loads = [(r["load"]["before"], r["load"]["after"]) for r in mppo_runs]
    print(f"mppo: TP{layout['tp']} PP{layout['pp']} DP{layout['dp']} ({opts.nproc} rank(s) x "
          f"{mppo['threads_per_rank']} thread(s)), CPU rollout engine; load before/after each run {loads}")
    if trl:
        loads = [(r["load"]["before"], r["load"]["after"]) for r in trl_runs]
        print(f"TRL: GRPOTrainer, transformers generate, {trl['threads']} thread(s); {versions}; load before/after "
              f"each run {loads}")
    print()
    print(render(mppo_sum, trl_sum, opts.last))
    sides = {"mppo": [r["steps"] for r in mppo_runs], **({"TRL": [r["steps"] for r in trl_runs]} if trl else {})}
    if opts.png:
        plot(opts.png, sides)
    if opts.json:
        opts.json.write_text(json.dumps({"options": {k: str(v) for k, v in vars(opts).items()}, "versions": versions,
                                         "mppo": mppo_runs, "trl": trl_runs,
                                         "summary": {"mppo": mppo_sum, "trl": trl_sum}},
                                        indent=1))
    return 0
