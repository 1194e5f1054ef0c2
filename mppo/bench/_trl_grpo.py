"""The TRL half of `mppo bench trl-compare`, and the reward both trainers optimise.

This file runs in two places, so its top level imports the standard library only:
- in mppo's environment, as a user reward function (`reward.custom_fn.path=<this file>`, name `compute_score`);
- in TRL's own virtualenv, as a script: `python _trl_grpo.py --model DIR --data FILE ... --out FILE` trains with
  `trl.GRPOTrainer` and writes per-step wall time, tokens and reward as JSON.

The reward is a toy a random tiny model can learn in a few steps (countdown's score is 0 for every sample of a
random model, which would compare nothing): the number of digit characters in the response, over 16, capped at
1. Both trainers see the same response text: special tokens removed, and for mppo (whose reward input is the
decoded prompt followed by the response) only the text after the prompt's last line.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

# The TinyZero countdown prompt ends with this line; everything after it is the response.
PROMPT_END = "Let me solve this step by step.\n<think>"
SPECIAL_TOKEN = re.compile(r"<\|[a-z_]+\|>")
DIGITS_FOR_FULL_SCORE = 16


def digit_score(response: str) -> float:
    """min(1, digit characters / 16) of a response text, special tokens (<|...|>) removed first."""
    text = SPECIAL_TOKEN.sub("", response)
    return min(1.0, sum(ch.isdigit() for ch in text) / DIGITS_FOR_FULL_SCORE)


def response_of(solution_str: str) -> str:
    """The response part of mppo's reward input (decoded prompt ++ response): the text after PROMPT_END."""
    head, marker, tail = solution_str.partition(PROMPT_END)
    if not marker:
        raise ValueError(f"the prompt does not end with {PROMPT_END!r}; this reward is for TinyZero countdown "
                         "prompts (template 'base')")
    return tail


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  **kwargs: Any) -> float:
    """mppo's reward-function signature (veRL's)."""
    return digit_score(response_of(solution_str))


def trl_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """TRL's reward-function signature: completions are decoded without special tokens."""
    return [digit_score(c) for c in completions]


# ---------------------------------------------------------------------------------------------------- TRL run
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="GRPO with trl.GRPOTrainer on CPU; writes per-step timings as JSON")
    p.add_argument("--model", required=True, help="HF model directory (model + tokenizer)")
    p.add_argument("--prompts", required=True, help="JSON list of prompt texts, in training order")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--response-length", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--workdir", required=True, help="TRL's output_dir (nothing is saved there but logs)")
    p.add_argument("--fixed-length", action="store_true",
                   help="exactly --response-length tokens per completion (min_new_tokens: EOS masked until then)")
    return p


def run_trl(opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if opts.threads:
        torch.set_num_threads(opts.threads)
    prompts = json.loads(open(opts.prompts).read())
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": prompts})
    config = trl.GRPOConfig(
        output_dir=opts.workdir, max_steps=opts.steps, per_device_train_batch_size=opts.prompts_per_step * opts.group,
        num_generations=opts.group, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=opts.response_length, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=opts.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        use_cpu=True, bf16=False, logging_steps=1, report_to="none", save_strategy="no", seed=opts.seed,
        disable_dropout=True, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": opts.response_length} if opts.fixed_length else None)

    # Time spent inside transformers' generate, per step: GRPOTrainer calls the (unwrapped, on one CPU process:
    # the same) model's generate once per generation batch, so an instance attribute wraps it.
    generate = model.generate
    generation_seconds = [0.0]

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            generation_seconds[0] += time.perf_counter() - start

    model.generate = timed_generate

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step (generation, scoring, loss, backward, optimizer) and its logs."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self._start = self._cpu_start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start, self._cpu_start = time.perf_counter(), time.process_time()
            generation_seconds[0] = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            # process CPU time: all of this process's threads (other processes on the machine do not count)
            self.steps.append({"seconds": time.perf_counter() - self._start,
                               "cpu_seconds": time.process_time() - self._cpu_start,
                               "generation_seconds": generation_seconds[0]})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and self.steps:
                self.steps[-1].update({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    clock = StepClock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=trl_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    previous = 0.0
    for step in clock.steps:  # num_tokens is cumulative (prompt + completion tokens)
        step["tokens"] = step.get("num_tokens", previous) - previous
        previous = step.get("num_tokens", previous)
    first_ids = tokenizer(text=prompts[:1])["input_ids"][0]
    return {"steps": clock.steps, "train_wall_s": wall, "threads": torch.get_num_threads(),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "first_prompt_ids": list(first_ids)}


def main() -> None:
    opts = _parser().parse_args()
    result = run_trl(opts)
    with open(opts.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
