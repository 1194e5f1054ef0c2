"""What a user sees of a run: veRL-named step metrics, the metrics file, TensorBoard/W&B, and the final plot.

Every step appends one JSON object to `<run_dir>/metrics.jsonl` (rank 0 only). Metric names follow veRL so
dashboards and habits carry over: `critic/score/mean`, `actor/pg_loss`, `timing_s/gen`, `perf/throughput`, ...
"""
from __future__ import annotations

import json
import logging
import math
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mppo.workers.batch_schema import UNREJECTED_MASK

log = logging.getLogger("mppo")


# ------------------------------------------------------------------------------------------------- batch metrics
def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: dict[str, torch.Tensor], *, max_response_length: int,
                         max_prompt_length: int) -> dict[str, float]:
    """veRL's `compute_data_metrics`: sequence-level score/reward sums, token-level advantage/return/value stats
    (over the tokens kept by rollout rejection), response lengths as generated."""
    mask = batch["response_mask"].bool()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", batch["advantages"][mask]))
    metrics.update(_stats("critic/returns", batch["returns"][mask]))
    if "values" in batch:
        values, returns = batch["values"][mask].float(), batch["returns"][mask].float()
        metrics.update(_stats("critic/values", values))
        var_returns = returns.var(unbiased=False) if returns.numel() > 1 else torch.tensor(0.0)
        metrics["critic/vf_explained_var"] = (1.0 - (returns - values).var(unbiased=False) /
                                              (var_returns + 1e-5)).item() if returns.numel() > 1 else 0.0
    response_length = batch.get(UNREJECTED_MASK, batch["response_mask"]).sum(-1).float()
    prompt_length = batch["prompt_mask"].sum(-1).float()
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length >= max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = (prompt_length >= max_prompt_length).float().mean().item()
    return metrics


def tool_call_metrics(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Multi-turn rollouts (rollout.multi_turn): `multi_turn/tool_call_rate` (responses with at least one tool
    call) and `multi_turn/num_tool_calls/{mean,max}`; nothing for single-turn batches."""
    calls = batch.get("num_tool_calls")
    if calls is None or calls.numel() == 0:
        return {}
    calls = calls.double()
    return {"multi_turn/tool_call_rate": (calls > 0).double().mean().item(),
            "multi_turn/num_tool_calls/mean": calls.mean().item(), "multi_turn/num_tool_calls/max": calls.max().item()}


def rollout_mismatch_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                             response_mask: torch.Tensor) -> dict[str, float]:
    """veRL 0.9.1's rollout-vs-actor metrics (`verl/utils/debug/metrics.py::calculate_debug_metrics`) over the
    response tokens of the batch given (the trainer gives the global batch, so they do not depend on the DP split).

    They compare PROBABILITIES, p = exp(log-prob), of the sampled tokens: the engine's against the actor's for the
    same weights. `diff = |p_actor - p_rollout|`; `_max`, `_mean`, `_std` (unbiased, as `torch.std`: NaN for a
    single token) of it, and the Pearson correlation of the two probability lists (`torch.corrcoef`: NaN when
    either is constant, e.g. a single token). No response token: `_valid` 0 and NaN for the rest. Computed in
    float64 (veRL: in the log-probs' dtype).
    """
    mask = response_mask.bool()
    if not bool(mask.any()):
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0.0, "training/rollout_probs_diff_max": nan,
                "training/rollout_probs_diff_mean": nan, "training/rollout_probs_diff_std": nan,
                "training/rollout_actor_probs_pearson_corr": nan}
    actor = torch.exp(old_log_probs.double())[mask]
    rollout = torch.exp(rollout_log_probs.double())[mask]
    diff = (actor - rollout).abs()
    std = diff.std().item() if diff.numel() > 1 else float("nan")  # torch.std of one element warns, gives NaN
    corr = torch.corrcoef(torch.stack([actor, rollout]))[0, 1].item() if diff.numel() > 1 else float("nan")
    return {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(), "training/rollout_probs_diff_std": std,
            "training/rollout_actor_probs_pearson_corr": corr}


# ------------------------------------------------------------------------------------------------- timing and perf
class StepTimer:
    """Accumulates wall time per phase under veRL's `timing_s/<phase>` names."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


_PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
_measured_peak: dict[str, float] = {}
PEAK_TRIALS = 5


def peak_flops(device: torch.device) -> float:
    """Per-device peak FLOP/s for MFU: the datasheet dense bf16 figure on known GPUs, else a measured matmul.

    On CPU there is no datasheet figure worth trusting, so a large fp32 matmul is timed once per process, with
    this process's threads: the best of several trials, since one trial slowed by another process on the cores
    would under-state the peak (and over-state MFU past 1).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _PEAK_BF16_FLOPS.items():
            if key in name:
                return value
    key = str(device)
    if key not in _measured_peak:
        n = 1024
        # its own generator: a draw from the run's would move dropout's stream in the first step of every process,
        # so a resumed run would diverge from the uninterrupted one
        numbers = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, generator=numbers)
        b = torch.randn(n, n, device=device, generator=numbers)
        a @ b  # warm-up
        best = 0.0
        for _ in range(PEAK_TRIALS):
            reps, start = 4, time.perf_counter()
            for _ in range(reps):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start))
        _measured_peak[key] = best
    return _measured_peak[key]


def perf_metrics(*, num_tokens: int, step_seconds: float, world_size: int, flops: float,
                 device: torch.device) -> dict[str, float]:
    """Throughput in tokens/s per rank and MFU = model FLOPs / (peak FLOP/s × ranks × step time)."""
    per_rank = num_tokens / max(step_seconds, 1e-9) / world_size
    mfu = flops / (peak_flops(device) * world_size * max(step_seconds, 1e-9))
    return {"perf/total_num_tokens": float(num_tokens), "perf/time_per_step": step_seconds,
            "perf/throughput": per_rank, "perf/mfu": mfu, **memory_metrics(device)}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """This rank's peak memory so far, in GiB: on a GPU veRL's `perf/max_memory_allocated_gb` and
    `perf/max_memory_reserved_gb` (torch's caching allocator); on the CPU `perf/cpu_memory_peak_gb`, the process's
    peak resident set (the kernel's VmHWM): everything the rank ever held at once, Python, the
    libraries and the allocator's free-but-kept pages included - what `mppo plan` predicts for a CPU rank."""
    if device.type == "cuda":
        return {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"perf/cpu_memory_peak_gb": _cpu_peak_kib() / 2**20}


def _cpu_peak_kib() -> int:
    """The kernel's VmHWM for this process (KiB). getrusage's ru_maxrss survives exec: a rank started by a large
    parent (pytest, a launcher) would report the parent's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ------------------------------------------------------------------------------------------------- sinks
class MetricsLogger:
    """Rank-0 sink for step metrics: metrics.jsonl always, plus the configured loggers (tensorboard, wandb)."""

    def __init__(self, run_dir: str | Path, loggers: Sequence[str], *, enabled: bool, project: str,
                 experiment: str, config: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # TensorBoard's writer is made at the first log, once a resume (truncate_after) may have set a purge step.
        self._tb_dir = Path(run_dir) / "tensorboard" if "tensorboard" in loggers else None
        self._tb_purge_step: int | None = None
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError("trainer.logger includes 'wandb' but wandb is not installed: "
                                   "pip install wandb, or drop it from trainer.logger") from err
            self._wandb = wandb.init(project=project, name=experiment, config=config)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint so the file reads as one uninterrupted run."""
        if not self.enabled:
            return
        self._tb_purge_step = step + 1  # TensorBoard hides the interrupted run's events from this step on
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if _parsed_step(line) is not None and _parsed_step(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is None and self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self._tb_dir), purge_step=self._tb_purge_step)
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _parsed_step(line: str) -> int | None:
    """The step of a metrics line; None for a blank or torn line (a crash mid-write on power loss)."""
    try:
        return int(json.loads(line).get("step", 0)) if line.strip() else None
    except (json.JSONDecodeError, AttributeError):
        return None


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


PLOT_PANELS = (("critic/score/mean", "train reward (score)"), ("val/test_score", "validation score"),
               ("actor/reward_kl_penalty", "KL (in reward)"), ("actor/ppo_kl", "KL (old→new policy)"),
               ("response_length/mean", "response length"))


def plot_metrics(metrics_path: str | Path, out_png: str | Path) -> Path:
    """A PNG of reward, validation score, KL and response length over steps."""
    # A bare Figure (no pyplot, no GUI backend) with fixed margins: tight_layout measured every tick label and took
    # twice the drawing's time, paid at the end of every run.
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path)
    fig = Figure(figsize=(4 * len(PLOT_PANELS), 3.2))
    axes = fig.subplots(1, len(PLOT_PANELS))
    for ax, (key, title) in zip(axes, PLOT_PANELS):
        series: dict[str, list[tuple[int, float]]] = {}
        for row in rows:
            for name, value in row.items():
                if (name == key or name.startswith(key + "/")) and isinstance(value, (int, float)):
                    series.setdefault(name, []).append((row["step"], value))
        for name, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                    label=name.removeprefix(key).lstrip("/") or None)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(series) > 1:
            ax.legend(fontsize=7)
        if not series:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.9, wspace=0.35)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    return out_png
