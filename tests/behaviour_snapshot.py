"""Bitwise snapshot of what the trainer computes, to show a refactor changed no behaviour (issue 28, as issue 17).

    python tests/behaviour_snapshot.py record DIR      # tiny runs under torchrun; each rank's tensors into DIR
    python tests/behaviour_snapshot.py compare A B     # every tensor and metric equal, bit for bit

Each case is a short run of the real trainer (PPOTrainer.fit on the tiny e2e assets). What is recorded goes through
the workers' API, not the fit loop's internals, so the fit loop can be rewritten under it: the batch each update
receives (responses, rewards, old/ref log-probs, values, advantages, returns and the rest), the metrics each update
returns, the reference's log-probs, the step metrics (less timings), the generations dumped to
trainer.rollout_data_dir, and every actor and critic parameter at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

# A coarse score, so that dynamic sampling finds groups whose responses all score the same
PARITY_REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(solution_str or "") % 2)
'''

# name -> (ranks, overrides beyond the tiny e2e ones; "{assets}" is the assets directory)
CASES: dict[str, tuple[int, list[str]]] = {
    # PPO: critic, KL in the reward (reference), two mini-batches (a separate old-log-prob pass), generations dumped
    "ppo_gae_kl": (1, ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
                       "trainer.rollout_data_dir={run}/generations"]),
    # GRPO at TP2: KL loss (reference), one mini-batch (old log-probs from the update's own forward)
    "grpo_tp2_kl_loss": (2, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "critic.enable=false",
                             "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=8"]),
    # ReMax (greedy baselines) with DAPO dynamic sampling and the overlong penalty, at DP2
    "remax_dapo_dp2": (2, ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2", "critic.enable=false",
                           "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
                           "algorithm.filter_groups.max_num_gen_batches=3", "data.gen_batch_size=8",
                           "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                           "reward.reward_kwargs.overlong_buffer_cfg.len=4",
                           "reward.custom_fn.path={assets}/parity_reward.py"]),
    # rollout correction: token IS weights with rejection, then bypass mode (engine log-probs as the old ones)
    "rollout_is": (1, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "critic.enable=false",
                       "algorithm.rollout_correction.rollout_is=token",
                       "algorithm.rollout_correction.rollout_rs=token_k1",
                       "algorithm.rollout_correction.rollout_rs_threshold=0.999_1.001"]),
    "bypass": (1, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "critic.enable=false",
                   "algorithm.rollout_correction.bypass_mode=true"]),
}


def rank_main(case: str, assets: str, out: str) -> None:
    """One rank of a case (under torchrun): run the trainer, record through the workers' API, save."""
    import torch

    from e2e_assets import dense_reward, tiny_overrides
    from mppo.config import load_config
    from mppo.trainer.fit import PPOTrainer

    world, extra = CASES[case]
    run = Path(out) / case / "run"
    overrides = (tiny_overrides(Path(assets), run, world=world, steps=2) + dense_reward(Path(assets))
                 + ["trainer.save_freq=-1", "trainer.test_freq=2"]
                 + [e.format(assets=assets, run=run) for e in extra])
    cfg = load_config("configs/demo_cpu.yaml", overrides, world_size=world)
    trainer = PPOTrainer(cfg)
    recorded: dict[str, object] = {}

    def cpu(value):
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu").clone()
        return value

    def record(name, fn, batch_arg=True):
        def wrapped(*args, **kwargs):
            key = f"step{trainer.step + 1}/{name}"
            if batch_arg:
                recorded[f"{key}/batch"] = {k: cpu(v) for k, v in args[0].items()}
            result = fn(*args, **kwargs)
            recorded[f"{key}/result"] = ({k: cpu(v) for k, v in result.items()} if isinstance(result, dict)
                                         else cpu(result))
            return result
        return wrapped

    trainer.actor.update = record("actor_update", trainer.actor.update)
    if trainer.critic is not None:
        trainer.critic.update = record("critic_update", trainer.critic.update)
    if trainer.ref is not None:
        trainer.ref.compute_log_prob = record("ref_log_prob", trainer.ref.compute_log_prob)
    trainer.fit()
    for role, worker in (("actor", trainer.actor), ("critic", trainer.critic)):
        if worker is not None:
            for i, chunk in enumerate(worker.model):
                for name, param in chunk.named_parameters():
                    recorded[f"final/{role}/{i}/{name}"] = cpu(param)
    rank = int(os.environ.get("RANK", 0))
    torch.save(recorded, Path(out) / case / f"rank{rank}.pt")


def record(out: Path, cases: list[str]) -> None:
    from dist_util import free_port
    from e2e_assets import make_assets

    assets = out / "assets"
    if not (assets / "model").is_dir():
        make_assets(assets)
    (assets / "parity_reward.py").write_text(PARITY_REWARD_FN)
    for case in cases:
        world = CASES[case][0]
        (out / case).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, "rank", case, str(assets),
               str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{HERE}"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        print(f"recorded {case}", flush=True)


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "async/"))} for row in rows]


def compare(a: Path, b: Path) -> int:
    import torch

    differences = 0
    for case in CASES:
        if not (a / case).is_dir():
            continue
        for file in sorted((a / case).glob("rank*.pt")):
            x, y = torch.load(file), torch.load(b / case / file.name)
            if sorted(x) != sorted(y):
                print(f"{case}/{file.name}: recorded keys differ: {sorted(set(x) ^ set(y))}")
                differences += 1
            for key in sorted(set(x) & set(y)):
                xs, ys = x[key], y[key]
                if not isinstance(xs, dict):
                    xs, ys = {"": xs}, {"": ys}
                if sorted(xs) != sorted(ys):
                    print(f"{case}/{file.name} {key}: keys differ {sorted(set(xs) ^ set(ys))}")
                    differences += 1
                for k in sorted(set(xs) & set(ys)):
                    u, v = xs[k], ys[k]
                    same = (torch.equal(u, v) if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)
                            else u == v or (u != u and v != v))
                    if not same:
                        print(f"{case}/{file.name} {key} {k}: differs")
                        differences += 1
        if _metrics(a / case / "run") != _metrics(b / case / "run"):
            print(f"{case}: metrics.jsonl differs")
            differences += 1
        for dump in sorted((a / case / "run" / "generations").glob("*.jsonl")):
            if dump.read_bytes() != (b / case / "run" / "generations" / dump.name).read_bytes():
                print(f"{case}: generations {dump.name} differ")
                differences += 1
        print(f"{case}: compared")
    print("bitwise equal" if differences == 0 else f"{differences} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    verb = sys.argv[1]
    if verb == "rank":
        rank_main(*sys.argv[2:5])
    elif verb == "record":
        record(Path(sys.argv[2]).resolve(), sys.argv[3:] or list(CASES))
    elif verb == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
