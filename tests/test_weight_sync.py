"""Weight sync from a megatron actor (TP2xPP2, TP2, PP2, TP1; 4 CPU ranks) into the CPU rollout engine.

One torchrun launch (tests/dist/weight_sync_parallel.py) runs every case. Checked against independent references:
the HF checkpoint's safetensors (engine weights, bit for bit), the megatron actor's own log-probs of the engine's
sequences (the workers' log-prob path, fp32, 1e-4), and the rollouts of the other layouts (same seed, same samples).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from dist_util import run_torchrun

SCRIPT = Path(__file__).parent / "dist" / "weight_sync_parallel.py"
ATOL = 1e-4
LAYOUTS = {"tp2pp2": 1, "tp2pp1": 2, "tp1pp2": 2, "tp1pp1": 4}  # layout -> DP
CASES = [("tp2pp2", "qwen2_untied"), ("tp2pp2", "qwen2_tied"), ("tp2pp1", "qwen2_untied"),
         ("tp1pp2", "qwen2_untied"), ("tp1pp1", "qwen2_untied")]
KINDS = ("sampled", "greedy")
# Engine holders (tp_rank 0, pp_rank 0 of each DP group) in megatron's rank order (TP fastest, then DP, then PP).
HOLDERS = {"tp2pp2": [0], "tp2pp1": [0, 2], "tp1pp2": [0, 1], "tp1pp1": [0, 1, 2, 3]}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("weight_sync")
    results = run_torchrun(SCRIPT, 4, out, timeout=600)
    for r in results:
        assert "crash" not in r, r["crash"]
    return results, out / "work"


def _get(ranks, rank, key):
    assert key in ranks[rank], f"{key} missing on rank {rank}"
    return ranks[rank][key]


def _sorted_rows(rows):
    return sorted(rows, key=lambda row: (row[0], row[1]))


@pytest.mark.parametrize("layout,model", CASES)
def test_engine_weights_equal_the_hf_checkpoint_bitwise(run, layout, model):
    ranks, work = run
    for rank in HOLDERS[layout]:
        assert _get(ranks, rank, f"{layout}/{model}/bitwise") == "ok", f"rank {rank}"
    with safe_open(str(work / model / "model.safetensors"), framework="pt") as f:
        checkpoint_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    for rank in range(4):
        sent, buckets = _get(ranks, rank, f"{layout}/{model}/sync")
        if rank in HOLDERS[layout]:
            assert sent == checkpoint_bytes, f"rank {rank} got {sent} bytes, the checkpoint holds {checkpoint_bytes}"
            assert buckets > 1
        else:  # only engine ranks are destinations: the others send their shards and receive nothing
            assert (sent, buckets) == (0, 0), f"rank {rank} holds no engine but was streamed {sent} bytes"


@pytest.mark.parametrize("layout,model", CASES)
def test_cpu_engine_keeps_the_staged_tensors_as_its_weights(run, layout, model):
    """gloo ranks on one host: the sync is staged in shared memory and the engine adopts it (no second copy)."""
    ranks, _ = run
    for rank in HOLDERS[layout]:
        assert _get(ranks, rank, f"{layout}/{model}/adopted") is True, f"rank {rank}"


@pytest.mark.parametrize("layout,model", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_rollout_logprobs_equal_actor_logprobs(run, layout, model, kind):
    ranks, _ = run
    worst = max(_get(ranks, r, f"{layout}/{model}/{kind}/actor_diff") for r in range(4))
    assert worst <= ATOL, f"{layout} {model} {kind}: max |engine - actor| log-prob = {worst}"


def test_logprob_check_is_sensitive_to_temperature(run):
    ranks, _ = run
    # The engine's T=0.7 log-probs against the actor at T=1: far apart, so matching at T=0.7 above means something.
    assert _get(ranks, 0, "tp2pp2/qwen2_untied/sampled/actor_diff_at_t1") > 100 * ATOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_seed_same_rollouts_across_tp_and_dp(run, layout, kind):
    ranks, _ = run
    reference = _sorted_rows(_get(ranks, 0, f"tp2pp2/qwen2_untied/{kind}/full_rollouts"))
    # rank 0's engine alone over all prompts (DP1), with weights from this layout's actor (TP1 or TP2)
    assert _sorted_rows(_get(ranks, 0, f"{layout}/qwen2_untied/{kind}/full_rollouts")) == reference
    # the DP groups' engines, each over its slice of the prompts, together
    pieces = [_get(ranks, r, f"{layout}/qwen2_untied/{kind}/dp_rollouts") for r in HOLDERS[layout]]
    assert len(pieces) == LAYOUTS[layout]
    assert all(len(p) == len(reference) // LAYOUTS[layout] for p in pieces)
    assert _sorted_rows([row for p in pieces for row in p]) == reference
    assert not any(f"{layout}/qwen2_untied/{kind}/dp_rollouts" in ranks[r]
                   for r in range(4) if r not in HOLDERS[layout])


def test_rollouts_are_really_sampled(run):
    ranks, _ = run
    sampled = _get(ranks, 0, "tp2pp2/qwen2_untied/sampled/full_rollouts")
    greedy = _get(ranks, 0, "tp2pp2/qwen2_untied/greedy/full_rollouts")
    by_prompt: dict[int, list] = {}
    for row in sampled:
        by_prompt.setdefault(row[0], []).append(row[2])
    assert all(len(s) == 2 and s[0] != s[1] for s in by_prompt.values()), "the n=2 samples of a prompt must differ"
    assert [row[2] for row in greedy] != [s[0] for s in by_prompt.values()]


def test_sync_after_changing_an_actor_shard(run):
    ranks, _ = run
    key = "tp2pp2/qwen2_untied/changed"
    # only TP rank 1's columns of the row-parallel down_proj changed, and the engine got exactly that
    assert _get(ranks, 0, f"{key}/left_half_same") is True
    assert _get(ranks, 0, f"{key}/right_half_changed") is True
    assert _get(ranks, 0, f"{key}/first_logprob_shift") > 1e-2
    worst = max(_get(ranks, r, f"{key}/actor_diff") for r in range(4))
    assert worst <= ATOL, f"after the change: max |engine - actor| log-prob = {worst}"


def test_benchmark_command_runs_on_a_tiny_model(tmp_path):
    """`mppo bench weight-sync` end to end (spawns its own ranks: TP2 here, the TP2 x PP2 sync is checked above), with
    the sync into a real sglang.Engine on the CPU too (SGLang is installed by `make test`); a smoke test, it asserts
    no speed."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "mppo", "bench", "weight-sync", "--hidden", "64", "--layers", "2", "--heads", "4",
           "--kv-heads", "2", "--ffn", "128", "--vocab", "512", "--tp", "2", "--pp", "1", "--repeats", "1",
           "--memcpy-mb", "8", "--bucket-mb", "1", "--collective-all", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "whole sync: push_actor_weights -> engine" in proc.stdout
    assert "whole sync into SGLang (CPU tier, engine TP 1):" in proc.stdout
    result = json.loads(out.read_text())
    # 2 layers x (qkv w+b, o, gate, up, down, 2 norms) + embed + lm_head + final norm, fp32
    h, f, kv, v = 64, 128, 2 * 16, 512
    layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    assert result["bytes"] == 4 * (2 * layer + 2 * v * h + h)
    assert all(s > 0 for s in result["seconds"].values())


def test_staging_another_model_to_the_engine_rank_leaves_the_engine_alone(run):
    """Staging buffers are per model: a second model exported to rank 0 must not rewrite the weights the engine
    kept from the actor's buffer."""
    ranks, _ = run
    assert _get(ranks, 0, "tp2pp2/qwen2_untied/bitwise_after_other_model") == "ok"


# ------------------------------------------------------------------------------------ transports and destinations
TRANSPORT_LAYOUTS = ("tp2pp2", "tp2pp1", "tp1pp2")
# case -> (destinations as "all" / "leader" / "last" / "two", what a destination must see)
TRANSPORT_CASES = {
    "collective_all": ("all", "ok/fresh"), "auto_all": ("all", "ok/fresh"),
    "collective_last": ("last", "ok/fresh"), "collective_two": ("two", "ok/fresh"),
    "auto_last": ("last", "ok/staged"), "shm_leader": ("leader", "ok/staged"),
    "shm_two": ("two", "ok/staged"), "shm_all": ("all", "ok/staged"),
}


@pytest.mark.parametrize("case", sorted(TRANSPORT_CASES))
@pytest.mark.parametrize("layout", TRANSPORT_LAYOUTS)
def test_every_transport_gives_destinations_the_hf_checkpoint_and_others_nothing(run, layout, case):
    """iter_hf_weights(destinations=..., transport=...) against the HF safetensors, bit for bit and in HF order;
    ranks that are not destinations get an empty stream. Shared memory and collectives agree because both equal
    the checkpoint."""
    ranks, _ = run
    who, want = TRANSPORT_CASES[case]
    key = f"{layout}/qwen2_untied/transport"
    for rank in range(4):
        group = _get(ranks, rank, f"{key}/group")
        chosen = {"all": group, "leader": group[:1], "last": group[-1:], "two": [group[0], group[-1]]}[who]
        got = _get(ranks, rank, f"{key}/{case}")
        assert got == (want if rank in chosen else "empty"), f"{case} rank {rank} (group {group}): {got}"


@pytest.mark.parametrize("case", ["shm_bf16", "collective_bf16"])
def test_transports_cast_like_the_checkpoint_cast(run, case):
    ranks, _ = run
    for rank in range(4):
        last = _get(ranks, rank, "tp2pp2/qwen2_untied/transport/group")[-1]
        want = ("ok/staged" if case.startswith("shm") else "ok/fresh") if rank == last else "empty"
        assert _get(ranks, rank, f"tp2pp2/qwen2_untied/transport/{case}") == want, f"rank {rank}"


def test_staging_leaves_no_files_or_mappings_behind(run):
    """Segments are unlinked as soon as every rank mapped them: after an export, after a consumer failed
    mid-stream, and after a setup failed; releasing the buffers unmaps them; exports after each failure are right."""
    ranks, _ = run
    key = "tp2pp2/qwen2_untied/life"
    for rank in range(4):
        assert _get(ranks, rank, f"{key}/first") == ("ok/staged" if rank == 0 else "empty")
        assert _get(ranks, rank, f"{key}/mapped") is True, f"rank {rank}: no staging segment mapped"
        for when in ("files_after_export", "files_after_error", "files_after_setup_error"):
            assert _get(ranks, rank, f"{key}/{when}") == [], f"rank {rank} {when}"
        assert _get(ranks, rank, f"{key}/unmapped_after_release") is True, f"rank {rank}"
        for when in ("after_error", "after_setup_error"):
            assert _get(ranks, rank, f"{key}/{when}") == ("ok/staged" if rank == 0 else "empty"), f"{when} {rank}"
    assert _get(ranks, 0, f"{key}/consumed_before_error") == 3


def test_staging_setup_failure_is_one_clear_error_on_every_rank(run):
    """/dev/shm too small on the destination: every rank raises StagingError naming the fix (none hangs)."""
    ranks, _ = run
    for rank in range(4):
        message = _get(ranks, rank, "tp2pp2/qwen2_untied/life/setup_error")
        assert "rank 0" in message and "free but the weight staging buffer needs" in message, message
        assert "--shm-size" in message and "transport='collective'" in message


def test_lora_bench_report_is_the_hand_computation(capsys):
    """`mppo bench weight-sync --lora-rank`: the LoRA lines are medians and ratios of what was measured, and a bad
    rank stops in one line."""
    from mppo.bench.weight_sync import main, render_lora

    lora = {"rank": 16, "bytes": {"merged": 800 << 20, "adapters": 10 << 20},
            "seconds": {"merged": [4.0, 3.0, 9.0], "adapters": [1.0, 0.75, 0.5]},
            "generate_seconds": {"adapter": [5.0, 5.0, 6.0], "merged": [4.0, 1.0, 4.0]}}
    text = " ".join(render_lora(lora).split())
    assert "merged sync (lora.merge=true) 4.000 s 800.0 MiB" in text, text
    assert "adapters-only sync (lora.merge=false) 0.750 s 10.0 MiB (speed-up 5.33x, 80x fewer bytes)" in text
    assert "base + adapter 5.000 s, merged weights (an engine without LoRA) 4.000 s (1.25x)" in text, text
    assert "saves 3.250 s per sync and costs 1.000 s per such batch" in text, text
    assert main(["--lora-rank", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("mppo bench weight-sync: --lora-rank -1: must be >= 0 (0: no LoRA "
                                                "comparison)")
