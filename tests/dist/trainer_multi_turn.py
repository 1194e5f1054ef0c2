"""Multi-turn trainer steps with a scripted tool-calling policy (run by tests/test_trainer_multi_turn.py).

Every rank's rollout engine is tests/scripted_engine.py's ScriptedEngine: conversation c (global prompt index * n +
sample) calls the calculator first when c is even, then answers; odd conversations answer at once. The trainer's
own models (a random tiny Qwen2) compute every log-prob, value and loss. Per case, one PPOTrainer runs one
train_step; the step's batch is gathered over DP on rank 0, which writes out/rank0.json with:
  * layout: expected vs actual token layout per row (assistant tokens in response_mask, tool tokens attended but out);
  * HF transformers references from the initial weights: log-probs and entropies of the response tokens;
  * the step's metrics and the gathered batch, for the hand computations in the test.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: scripted_engine

from scripted_engine import ScriptedEngine  # noqa: E402
from dist_util import hf_response_log_softmax  # noqa: E402

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3 * 4"}}</tool_call>'
ANSWER = " <answer>14</answer>"
DIRECT = " The answer is <answer>2 + 3 * 4</answer>"


def policy(conversation: int, tool_turns: int) -> str:
    if conversation % 2 == 0:
        return CALL if tool_turns == 0 else ANSWER
    return DIRECT


def hf_stats(batch: dict[str, torch.Tensor], model_path: str, temperature: float):
    """(log p(response token), entropy) [B, T] of the initial weights, from HF logits of the batch's sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    logp = hf_response_log_softmax(batch, model, temperature)
    token_logp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def expected_layout(tok, conversation: int) -> tuple[list[int], list[int]]:
    from mppo.rollout.agent_loop import tool_turn_ids

    def said(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + ([] if text.endswith("</tool_call>")
                                                            else [tok.eos_token_id])

    if conversation % 2:
        ids = said(DIRECT)
        return ids, [1] * len(ids)
    call, tool, answer = said(CALL), tool_turn_ids(tok, ["14"]), said(ANSWER)
    return call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer)


def val_expected(trainer, tok) -> list[list[str]]:
    """(prompt text, the model's tokens as text) of each validation prompt, as the script answers it (n = 1)."""
    out = []
    dataset = trainer.data.val_dataset
    for i in range(len(dataset) - len(dataset) % trainer.dims.dp):
        ids, mask = expected_layout(tok, i)
        out.append([dataset[i].raw_prompt, tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--cases", required=True, help="JSON {name: overrides}")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from mppo.config import load_config
    from mppo.data import load_tokenizer
    from mppo.parallel import destroy, init_distributed
    from mppo.rollout.factory import Rollout, launch_layout
    from mppo.trainer.rollout_batch import all_gather_rows

    world = int(os.environ["WORLD_SIZE"])
    result: dict[str, dict] = {}
    for name, overrides in json.loads(args.cases).items():
        cfg = load_config(args.config, overrides, world_size=world)
        init_distributed(1, 1)  # the rollout's gloo group is made on the launch's process group
        tok = load_tokenizer(cfg.actor_rollout_ref.model.path)
        rollout = Rollout("cpu", ScriptedEngine(tok, policy), launch_layout(1), free_cache_engine=True,
                          object_group=dist.new_group(backend="gloo") if world > 1 else None)
        destroy()
        from mppo.trainer.fit import PPOTrainer

        trainer = PPOTrainer(cfg, rollout=rollout)
        captured: list[dict] = []
        compute = trainer.compute_advantages

        def recording(batch, compute=compute, captured=captured, trainer=trainer):
            metrics = compute(batch)
            captured.append({k: all_gather_rows(v.detach().cpu(), trainer.io.dp_group) for k, v in batch.items()
                             if v.dim() >= 1 and v.shape[0] == batch["responses"].shape[0]})
            return metrics

        trainer.compute_advantages = recording
        prompts = next(iter(trainer.data.train_loader))
        metrics = {k: float(v) for k, v in trainer.train_step(prompts).items()}
        metrics.update(trainer.validate())  # validation rolls out through the agent loop too
        batch = captured[0]
        if trainer.is_main:
            n = cfg.actor_rollout_ref.rollout.n
            rows = []
            for r in range(batch["responses"].shape[0]):
                conversation = int(prompts.indices[r // n]) * n + r % n
                ids, mask = expected_layout(tok, conversation)
                length = int(batch["attention_mask"][r, batch["prompt_mask"].shape[1]:].sum())
                rows.append({"conversation": conversation, "expected_ids": ids, "expected_mask": mask,
                             "ids": batch["responses"][r, :length].tolist(),
                             "mask": batch["response_mask"][r, :length].tolist(),
                             "mask_after": batch["response_mask"][r, length:].tolist(),
                             "prompt_text": prompts.raw_prompts[r // n],
                             "assistant_text": tok.decode(batch["responses"][r][batch["response_mask"][r].bool()]
                                                          .tolist(), skip_special_tokens=False)})
            hf_logp, hf_entropy = hf_stats(batch, cfg.actor_rollout_ref.model.path,
                                           cfg.actor_rollout_ref.rollout.temperature)
            keep = ("response_mask", "uid", "old_log_probs", "rollout_log_probs", "values", "returns",
                    "advantages", "token_level_rewards", "token_level_scores", "num_tool_calls")
            result[name] = {"metrics": metrics, "rows": rows, "hf_log_probs": hf_logp.tolist(),
                            "val_expected": val_expected(trainer, tok),
                            "hf_entropy": hf_entropy.tolist(),
                            "batch": {k: batch[k].tolist() for k in keep if k in batch}}
        trainer.watchdog.close()
        trainer.metrics.close()
        destroy()
    group_case = group_of_two(tok) if world == 2 else {}
    mine = result if dist.get_rank() == 0 else {}
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps({**mine, "group_of_two": group_case}))


def group_of_two(tok) -> dict:
    """An engine group of both ranks (as an SGLang engine of TP 2, whose ranks all receive the driver's outputs):
    tools run on the group's first rank and every rank gets its messages, even where its own run would differ;
    the group's rollout equals the one of a group of one."""
    from mppo.rollout.agent_loop import AgentLoop
    from mppo.rollout.base import SamplingParams
    from mppo.rollout.factory import Rollout, rollout_layout
    from mppo.rollout.tools import ToolCall

    class RankAgent(AgentLoop):
        def local_tools(self):
            if dist.get_rank() == 0:
                return super().local_tools()
            return lambda calls: [f"rank {dist.get_rank()}'s own run"] * len(calls)

    agent = RankAgent(tok, 3, 5.0, 64, "middle")
    rank = dist.get_rank()
    layout = rollout_layout(2, rank=rank, world=2, local_rank=rank, local_world=2)
    group, everyone = dist.new_group([0, 1], backend="gloo"), dist.new_group(backend="gloo")
    engine = ScriptedEngine(tok, policy)
    engine.update_weights([])
    rollout = Rollout("sglang", engine, layout, free_cache_engine=False, object_group=everyone, group_comm=group)
    texts = rollout._group_tools(agent)([ToolCall("calculator", {"expression": "6 * 7"})])
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"question {i}"}],
                                                  add_generation_prompt=True, tokenize=False), add_special_tokens=False)
               for i in range(3)]
    sampling = SamplingParams(n=2, max_new_tokens=160, stop_token_ids=(tok.eos_token_id,))
    grouped = rollout.generate(prompts, sampling, step=0, first_index=5, agent=agent)
    alone = agent.generate(engine, prompts, sampling, step=0, prompt_offsets=[5, 6, 7],
                           run_tools=AgentLoop.local_tools(agent))  # the real tools, on this rank
    alone = [dataclasses.replace(r, policy_version=rollout.version) for r in alone]  # the Rollout stamps its version
    return {"texts": texts, "responses_equal": [vars(r) for r in grouped] == [vars(r) for r in alone],
            "num_responses": len(grouped), "tool_calls": [r.num_tool_calls for r in grouped]}


if __name__ == "__main__":
    main()
