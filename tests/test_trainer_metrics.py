"""What a user sees: veRL-named data metrics against hand computation, the metrics file, resume truncation, plot."""
from __future__ import annotations

import json

import pytest
import torch

from mppo.data.loader import PromptBatch
from mppo.rollout.base import RolloutResponse
from mppo.trainer.metrics import MetricsLogger, compute_data_metrics, plot_metrics, read_metrics
from mppo.trainer.rollout_batch import build_rollout_batch


def test_data_metrics_match_hand_computation():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    batch = {
        "response_mask": mask,
        "prompt_mask": torch.tensor([[0, 1], [1, 1]]),
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]]),
        "token_level_rewards": torch.tensor([[0.0, 0.9, 0.0], [0.5, 0.0, 0.0]]),
        "advantages": torch.tensor([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0]]),
        "returns": torch.tensor([[1.0, 1.0, 99.0], [0.0, 99.0, 99.0]]),
        "values": torch.tensor([[0.5, 0.5, 99.0], [0.0, 99.0, 99.0]]),
    }
    m = compute_data_metrics(batch, max_response_length=3, max_prompt_length=2)
    assert m["critic/score/mean"] == pytest.approx(0.75)
    assert m["critic/rewards/mean"] == pytest.approx(0.7)
    assert m["critic/advantages/mean"] == pytest.approx(7 / 3)  # padding (99) excluded
    assert m["critic/advantages/max"] == 4.0
    assert m["critic/returns/min"] == 0.0
    assert m["critic/values/mean"] == pytest.approx(1 / 3)
    assert m["response_length/mean"] == 1.5 and m["response_length/clip_ratio"] == 0.0
    assert m["prompt_length/mean"] == 1.5 and m["prompt_length/clip_ratio"] == 0.5
    # explained variance: 1 - var(returns - values) / var(returns), population variances over valid tokens
    r, v = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.5, 0.5, 0.0])
    expected = 1 - (r - v).var(unbiased=False) / (r.var(unbiased=False) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(expected.item())


def test_rollout_batch_layout():
    prompts = PromptBatch(input_ids=torch.tensor([[9, 5, 6], [7, 8, 4]]),
                          attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                          position_ids=torch.tensor([[0, 0, 1], [0, 1, 2]]), raw_prompts=["a", "b"],
                          data_sources=["x", "x"], ground_truths=[1, 2], extra_infos=[{}, {}],
                          indices=torch.tensor([10, 11]))
    responses = [RolloutResponse(0, 0, [1], [-0.5], "stop"), RolloutResponse(0, 1, [2, 3], [-1.0, -2.0], "length"),
                 RolloutResponse(1, 0, [4, 5], [-0.1, -0.2], "length"), RolloutResponse(1, 1, [6], [-0.3], "stop")]
    b = build_rollout_batch(prompts, responses, n=2, max_response_length=3, pad_token_id=0)
    assert b["input_ids"].tolist()[1] == [9, 5, 6, 2, 3, 0]
    assert b["attention_mask"].tolist()[1] == [0, 1, 1, 1, 1, 0]
    assert b["position_ids"].tolist()[1] == [0, 0, 1, 2, 3, 3]
    assert b["response_mask"].tolist()[3] == [1, 0, 0]
    assert b["rollout_log_probs"][1].tolist() == [-1.0, -2.0, 0.0]
    assert b["uid"].tolist() == [10, 10, 11, 11]
    with pytest.raises(ValueError, match="more than max_response_length"):
        build_rollout_batch(prompts, responses, n=2, max_response_length=1, pad_token_id=0)


def test_metrics_file_truncates_on_resume_and_plots(tmp_path):
    logger = MetricsLogger(tmp_path, ["console"], enabled=True, project="p", experiment="e")
    for step in range(1, 5):
        logger.log(step, {"critic/score/mean": step / 10, "val/test_score/countdown": step / 20,
                          "actor/ppo_kl": float("nan") if step == 2 else 0.0})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[1]["actor/ppo_kl"] == "nan"
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "critic/sc')  # a torn last line
    logger.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert png.stat().st_size > 1000
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["critic/score/mean"] == 0.1


def test_tensorboard_events_written(tmp_path):
    logger = MetricsLogger(tmp_path, ["tensorboard"], enabled=True, project="p", experiment="e")
    logger.log(1, {"actor/pg_loss": 0.5})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_hides_the_interrupted_runs_steps_after_resume(tmp_path):
    """A run logged steps 1-3, crashed, and resumed from the step-1 checkpoint: TensorBoard must show steps 1, 2, 3
    once each, with the resumed run's values (as metrics.jsonl does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, ["tensorboard"], enabled=True, project="p", experiment="e")
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, ["tensorboard"], enabled=True, project="p", experiment="e")
    resumed.truncate_after(1)
    for step in (2, 3):
        resumed.log(step, {"x": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_cpu_memory_peak_is_the_process_high_water_mark(tmp_path):
    """perf/cpu_memory_peak_gb against the kernel's own VmHWM (/proc/self/status), in a fresh process that
    writes a 512 MiB tensor and frees it: the metric reaches the resident set + the tensor and keeps the peak
    after the memory is returned."""
    import subprocess
    import sys

    script = """
import json, torch
from mppo.trainer.metrics import memory_metrics
def status_gib(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) / 2**20
rss_before = status_gib("VmRSS")
x = torch.ones(2**27)  # 512 MiB of fp32, written
del x
after = memory_metrics(torch.device("cpu"))["perf/cpu_memory_peak_gb"]
print(json.dumps({"rss_before": rss_before, "after": after, "hwm": status_gib("VmHWM"), "rss": status_gib("VmRSS")}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["after"] == pytest.approx(m["hwm"], abs=0.01)
    # the peak holds what was resident when the tensor was written plus the tensor (the earlier peak, e.g. of
    # the imports, may be higher than what stayed resident, so the rise is measured from the resident set)
    assert m["after"] >= m["rss_before"] + 0.45
    assert m["rss"] < m["after"] - 0.3  # freed: the current resident set fell, the peak stays


def _mismatch_reference(rollout_lp, actor_lp, mask):
    """veRL's debug metrics written out with plain Python loops in float64 (probabilities, not log-probs)."""
    import math

    diffs, xs, ys = [], [], []
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if mask[i][t]:
                x, y = math.exp(float(actor_lp[i][t])), math.exp(float(rollout_lp[i][t]))
                xs.append(x), ys.append(y), diffs.append(abs(x - y))
    n = len(diffs)
    mean = sum(diffs) / n
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    corr = sxy / math.sqrt(sxx * syy) if n > 1 and sxx > 0 and syy > 0 else math.nan
    return {"max": max(diffs), "mean": mean, "std": std, "corr": corr}


@pytest.mark.parametrize("case", ["random", "holes", "one_token", "constant_actor"])
def test_rollout_mismatch_metrics_match_an_independent_loop(case):
    """training/rollout_probs_diff_{max,mean,std} and the Pearson correlation of probabilities (veRL 0.9.1
    debug metrics) over response tokens only; padding holds garbage that must not count."""
    import math

    from mppo.trainer.metrics import rollout_mismatch_metrics

    g = torch.Generator().manual_seed(7)
    actor = -torch.rand(5, 9, generator=g) * 4
    rollout = actor + 0.3 * torch.randn(5, 9, generator=g)
    mask = torch.ones(5, 9)
    if case == "holes":
        mask = (torch.rand(5, 9, generator=g) > 0.4).float()
        mask[2] = 0.0  # an empty row
    if case == "one_token":
        mask = torch.zeros(5, 9)
        mask[3, 4] = 1.0
    if case == "constant_actor":
        actor = torch.full_like(actor, -0.5)
    padding = mask == 0
    actor_garbage, rollout_garbage = actor.masked_fill(padding, 123.0), rollout.masked_fill(padding, -7.0)
    got = rollout_mismatch_metrics(rollout_garbage, actor_garbage, mask)
    want = _mismatch_reference(rollout.tolist(), actor.tolist(), mask.tolist())
    assert got["training/rollout_probs_diff_valid"] == 1.0
    assert got["training/rollout_probs_diff_max"] == pytest.approx(want["max"], rel=1e-9)
    assert got["training/rollout_probs_diff_mean"] == pytest.approx(want["mean"], rel=1e-9)
    for key, name in (("training/rollout_probs_diff_std", "std"), ("training/rollout_actor_probs_pearson_corr", "corr")):
        if math.isnan(want[name]):
            assert math.isnan(got[key]), (key, got[key])
        else:
            assert got[key] == pytest.approx(want[name], rel=1e-9, abs=1e-12), key


def test_rollout_mismatch_metrics_without_response_tokens_are_invalid_not_an_error():
    import math

    from mppo.trainer.metrics import rollout_mismatch_metrics

    got = rollout_mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
    assert got["training/rollout_probs_diff_valid"] == 0.0
    assert all(math.isnan(v) for k, v in got.items() if k != "training/rollout_probs_diff_valid")


def test_tool_call_metrics_count_responses_with_calls():
    import torch

    from mppo.trainer.metrics import tool_call_metrics

    calls = [0, 2, 1, 0, 0, 3, 0, 0]
    metrics = tool_call_metrics({"num_tool_calls": torch.tensor(calls)})
    assert metrics == {"multi_turn/tool_call_rate": 3 / 8, "multi_turn/num_tool_calls/mean": 6 / 8,
                       "multi_turn/num_tool_calls/max": 3.0}
    assert tool_call_metrics({"response_mask": torch.ones(2, 3)}) == {}  # single-turn batches: nothing
