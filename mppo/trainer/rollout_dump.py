"""`trainer.rollout_data_dir` (veRL's key): every training step's generations as JSON lines, `<dir>/<step>.jsonl`,
one line per response, to read what the policy wrote (a tool call, a reasoning trace, a reward hack).

A line is veRL's `input`, `output`, `score` and `step`, plus `uid` (the group id: the responses of one prompt share
it; the prompt's dataset index, shifted by a multiple of the dataset size for dynamic sampling's extra batches)
and, for multi-turn rollouts, `num_tool_calls`. `output` is the whole response as the model saw it, tool turns
included, special tokens kept (they mark the turns); padding is left out. The rows are the update's batch: after
dynamic sampling's filtering, in global row order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mppo.workers.batch_schema import read_by

# The tensors a dump reads, gathered over DP before it is written.
DUMP_INPUTS = read_by("dump")


def dump_generations(out_dir: Path, step: int, batch: dict[str, torch.Tensor], tokenizer) -> Path:
    """Write `out_dir/<step>.jsonl` from the global batch's DUMP_INPUTS; returns its path."""
    prompt_columns = batch["prompt_mask"].shape[1]
    response_attention = batch["attention_mask"][:, prompt_columns:].bool()
    scores = batch["token_level_scores"].sum(-1)
    calls = batch.get("num_tool_calls")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{step}.jsonl"
    with open(path, "w") as f:
        for r in range(batch["responses"].shape[0]):
            prompt = batch["input_ids"][r, :prompt_columns][batch["prompt_mask"][r].bool()]
            response = batch["responses"][r][response_attention[r]]
            line = {"input": tokenizer.decode(prompt.tolist(), skip_special_tokens=False),
                    "output": tokenizer.decode(response.tolist(), skip_special_tokens=False),
                    "score": float(scores[r]), "step": step, "uid": int(batch["uid"][r])}
            if calls is not None:
                line["num_tool_calls"] = int(calls[r])
            f.write(json.dumps(line) + "\n")
    return path
