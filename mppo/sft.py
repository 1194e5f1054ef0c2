"""`mppo sft`: supervised fine-tuning (a warm-up before RL) of an HF Qwen2-architecture model on task rows.

Each row of a task parquet (mppo.data.tasks' format) becomes prompt -> response, where the response is the
row's `extra_info.solution` written the way the task's reward reads it:

    prompt ends with "<think>":   " </think> <answer> SOLUTION </answer>"
    otherwise (e.g. "Assistant:"): " <think> </think> <answer> SOLUTION </answer>"

followed by the tokenizer's EOS token. The prompt is rendered and tokenized exactly as the RL dataset does
(mppo.data.RLDataset), and the response is tokenized on its own and appended, so the token boundary at the end of
the prompt is the one the rollout engine continues from. The loss is the mean cross-entropy over response tokens
(EOS included); prompt and padding tokens carry no loss.

With `--solution-noise P`, a seeded fraction P of the demonstrations has each arithmetic operator of its solution
replaced by one drawn at random from + - * / (it may draw the right one): the warm-up still teaches the answer
format and the use of the prompt's numbers, but its model picks the right operator only part of the time, which
leaves RL something to improve (the CPU demo).

Runs on the transformers model (fp32, one process, CPU or CUDA) and saves an HF model directory (safetensors,
config.json, generation_config.json and the tokenizer files) atomically. `--init-tiny` starts from a random tiny
Qwen2 sized to the tokenizer instead of a pretrained model, for the CPU demo and tests.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mppo.data import DatasetError, RLDataset, load_tokenizer
from mppo.data.tokenizer import TokenizerLoadError
from mppo.models.atomic import atomic_directory
from mppo.models.remote_code import RemoteCodeError, check_remote_code
from mppo.models.weights import TOKENIZER_FILES
from mppo.sft_examples import (SFTError, SFTExample, build_examples, format_response,  # noqa: F401 (public)
                                noisy_solution)
from mppo.sft_tool import build_tool_examples

IGNORE_INDEX = -100  # label of a position without loss (prompt, padding)


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 200  # optimizer steps
    lr: float = 1e-3  # peak learning rate (AdamW), linear warm-up then constant
    warmup_steps: int = 10
    weight_decay: float = 0.0
    batch_size: int = 32  # rows per optimizer step, drawn by a seeded shuffle, epoch after epoch
    max_prompt_length: int = 1024  # longer prompts are an error (as data.filter_overlong_prompts="error")
    max_response_length: int = 64  # a target response (with EOS) longer than this is an error
    max_rows: int | None = None  # use only the first N rows of the data (a partial warm-up); None: all
    solution_noise: float = 0.0  # fraction of demonstrations whose operators are replaced by random ones
    tool_fraction: float = 0.0  # fraction of countdown/multiply rows demonstrated with calculator calls (sft_tool)
    tool_retry_fraction: float = 0.0  # fraction of those whose first call is a wrong candidate, then the right one
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "batch_size", "max_prompt_length", "max_response_length"):
            if getattr(self, name) < 1:
                raise SFTError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0:
            raise SFTError(f"lr must be positive, got {self.lr}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise SFTError("warmup_steps, weight_decay and clip_grad must not be negative")
        for name in ("solution_noise", "tool_fraction", "tool_retry_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SFTError(f"{name} is a fraction in [0, 1], got {getattr(self, name)}")
        if self.max_rows is not None and self.max_rows < 1:
            raise SFTError(f"max_rows must be positive (or None for all rows), got {self.max_rows}")


@dataclass(frozen=True)
class TinyModelSpec:
    """A random Qwen2 for `--init-tiny`; vocab_size comes from the tokenizer."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int | None = None  # None: 4 * hidden_size
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0


@dataclass
class SFTResult:
    model: torch.nn.Module  # the fine-tuned model (on CPU, eval mode), as saved
    losses: list[float]  # the loss of every optimizer step


def collate(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask and labels = input_ids on response tokens, IGNORE_INDEX elsewhere.
    Right padding keeps every row's positions 0..n-1, as in the unpadded sequence."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids = torch.tensor(example.input_ids, dtype=torch.long)
        input_ids[row, :n] = ids
        attention_mask[row, :n] = 1
        labels[row, example.prompt_length:n] = ids[example.prompt_length:]
        if example.loss_mask is not None:
            hole = torch.tensor(example.loss_mask, dtype=torch.bool).logical_not()
            labels[row, example.prompt_length:n][hole] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def response_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over all response tokens of the batch (the token-mean over the batch)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]  # the token at t+1 is predicted from position t
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def init_tiny_model(tokenizer: Any, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0) -> torch.nn.Module:
    """A randomly initialised fp32 Qwen2ForCausalLM whose vocabulary is the tokenizer's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if spec.num_heads % spec.num_kv_heads != 0 or spec.hidden_size % spec.num_heads != 0:
        raise SFTError(f"need hidden ({spec.hidden_size}) divisible by heads ({spec.num_heads}) and heads divisible "
                       f"by kv-heads ({spec.num_kv_heads})")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta, use_sliding_window=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float()


def load_model(path: str | os.PathLike[str], trust_remote_code: bool = False) -> torch.nn.Module:
    """The HF model at `path` in fp32; a model that needs its own code loads only with `trust_remote_code`
    (mppo.models.remote_code; without it, one line: RemoteCodeError)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no HF model in {os.fspath(path)!r} (no config.json); give an HF model directory "
                                "to --model, or use --init-tiny --tokenizer DIR for a random tiny model")
    check_remote_code(path, trust_remote_code, flag="--trust-remote-code")
    return AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32, local_files_only=True,
                                                trust_remote_code=trust_remote_code)


def _lr_factor(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def train(model: torch.nn.Module, examples: Sequence[SFTExample], pad_token_id: int, config: SFTConfig, *,
          device: str | torch.device = "cpu", progress: bool = True) -> list[float]:
    """Fine-tune `model` in place for config.steps AdamW steps; returns the loss of every step."""
    from tqdm import tqdm

    config.check()
    if not examples:
        raise SFTError("no training examples")
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config.warmup_steps))
    generator = torch.Generator().manual_seed(config.seed)
    order: list[int] = []
    losses = []
    bar = tqdm(range(config.steps), desc="sft", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        # a fresh seeded permutation each time the previous one runs out: every row once per epoch
        while len(order) < config.batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        chosen, order = order[:config.batch_size], order[config.batch_size:]
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in chosen], pad_token_id).items()}
        loss = response_loss(model, batch)
        if not math.isfinite(loss.item()):
            raise SFTError(f"the loss became {loss.item()}; lower --lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
    model.eval()
    return losses


def save(model: torch.nn.Module, tokenizer_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
         overwrite: bool = False) -> None:
    """Write an HF model directory atomically: the model (safetensors + config) and the tokenizer's files (with its
    own code, when it has some: mppo.models.remote_code)."""
    from mppo.models.remote_code import custom_code_files

    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / name
            if name != "generation_config.json" and source.is_file():
                shutil.copy2(source, tmp / name)
        for source in custom_code_files(tokenizer_dir):
            if not (tmp / source.name).exists():  # save_pretrained wrote the model's own code already
                shutil.copy2(source, tmp / source.name)


def run_sft(data: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, model_path: str | None = None,
            tokenizer_path: str | None = None, tiny: TinyModelSpec | None = None, config: SFTConfig = SFTConfig(),
            device: str = "cpu", overwrite: bool = False, progress: bool = True,
            trust_remote_code: bool = False) -> SFTResult:
    """Fine-tune a model (`model_path`, or a random tiny one when `tiny` is given) on `data` and save it to
    `out_dir`. The tokenizer comes from `tokenizer_path`, else from `model_path`. `trust_remote_code`: the model
    and tokenizer may run their own code (--trust-remote-code)."""
    config.check()
    if (model_path is None) == (tiny is None):
        raise SFTError("give exactly one of a model (--model HF_DIR) or a tiny random model (--init-tiny)")
    tokenizer_dir = tokenizer_path or model_path
    if tokenizer_dir is None:
        raise SFTError("--init-tiny needs --tokenizer DIR (e.g. one written by mppo.data.build_local_tokenizer)")
    if Path(out_dir).exists() and not overwrite:
        raise SFTError(f"{os.fspath(out_dir)!r} already exists; choose a new --out directory or pass --overwrite")
    if model_path is not None:  # before the data is read: a refused model should stop at once
        check_remote_code(model_path, trust_remote_code, flag="--trust-remote-code")
    tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code, flag="--trust-remote-code")
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = RLDataset(data, tokenizer, max_prompt_length=config.max_prompt_length,
                        filter_overlong_prompts="error")
    if config.tool_fraction > 0:
        examples = build_tool_examples(dataset, tokenizer, config.max_response_length,
                                       tool_fraction=config.tool_fraction, retry_fraction=config.tool_retry_fraction,
                                       max_rows=config.max_rows, solution_noise=config.solution_noise,
                                       seed=config.seed)
    else:
        examples = build_examples(dataset, tokenizer, config.max_response_length, config.max_rows,
                                  config.solution_noise, config.seed)
    torch.manual_seed(config.seed)
    model = init_tiny_model(tokenizer, tiny, config.seed) if tiny is not None else load_model(model_path,
                                                                                            trust_remote_code)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise SFTError(f"the model's vocabulary ({model.get_input_embeddings().weight.shape[0]}) is smaller than "
                       f"the tokenizer's ({len(tokenizer)}); use the model's own tokenizer")
    losses = train(model, examples, pad_token_id, config, device=device, progress=progress)
    model.cpu()
    save(model, tokenizer_dir, out_dir, overwrite=overwrite)
    return SFTResult(model, losses)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mppo sft", description=(
        "Supervised warm-up: train prompt -> extra_info.solution (in the reward's answer format) on a task "
        "parquet written by `mppo data`, and save an HF model directory."))
    parser.add_argument("--data", required=True, help="train parquet (e.g. DIR/train.parquet from `mppo data`)")
    parser.add_argument("--out", required=True, help="directory for the fine-tuned HF model (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="HF model directory to start from (its tokenizer unless --tokenizer)")
    source.add_argument("--init-tiny", action="store_true", help="start from a random tiny Qwen2 (needs --tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer directory")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let a model or tokenizer that ships its own Python code (auto_map) run it")
    tiny = parser.add_argument_group("tiny model (--init-tiny)")
    tiny.add_argument("--hidden", type=int, default=TinyModelSpec.hidden_size)
    tiny.add_argument("--layers", type=int, default=TinyModelSpec.num_layers)
    tiny.add_argument("--heads", type=int, default=TinyModelSpec.num_heads)
    tiny.add_argument("--kv-heads", type=int, default=TinyModelSpec.num_kv_heads)
    tiny.add_argument("--intermediate", type=int, default=None, help="MLP size (default 4 x hidden)")
    tiny.add_argument("--max-positions", type=int, default=TinyModelSpec.max_position_embeddings)
    tiny.add_argument("--untie-embeddings", action="store_true", help="separate input embedding and output layer")
    train_args = parser.add_argument_group("training")
    defaults = SFTConfig()
    train_args.add_argument("--steps", type=int, default=defaults.steps)
    train_args.add_argument("--lr", type=float, default=defaults.lr)
    train_args.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    train_args.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    train_args.add_argument("--batch-size", type=int, default=defaults.batch_size)
    train_args.add_argument("--max-prompt-length", type=int, default=defaults.max_prompt_length)
    train_args.add_argument("--max-response-length", type=int, default=defaults.max_response_length)
    train_args.add_argument("--max-rows", type=int, default=None, help="train on the first N rows only")
    train_args.add_argument("--solution-noise", type=float, default=defaults.solution_noise, metavar="P",
                            help="a fraction P of the demonstrations gets random operators (+ - * /) in place of "
                                 "the solution's: the format is learnt, the choice of operator only partly")
    train_args.add_argument("--tool-fraction", type=float, default=defaults.tool_fraction, metavar="P",
                            help="countdown and multiply: a fraction P of the demonstrations calls the calculator "
                                 "(hermes tool call, its real output as a tool turn out of the loss, then the answer)")
    train_args.add_argument("--tool-retry-fraction", type=float, default=defaults.tool_retry_fraction, metavar="Q",
                            help="a fraction Q of the tool demonstrations first calls a wrong candidate, reads "
                                 "its result and calls again")
    train_args.add_argument("--seed", type=int, default=defaults.seed)
    train_args.add_argument("--device", default="cpu", help="cpu or cuda")
    train_args.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `mppo sft ...`; returns the exit status (2 for a usage or data error)."""
    args = build_parser().parse_args(argv)
    config = SFTConfig(steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                       batch_size=args.batch_size, max_prompt_length=args.max_prompt_length,
                       max_response_length=args.max_response_length, max_rows=args.max_rows, seed=args.seed,
                       solution_noise=args.solution_noise, tool_fraction=args.tool_fraction,
                       tool_retry_fraction=args.tool_retry_fraction)
    tiny = None
    if args.init_tiny:
        tiny = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                             num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                             max_position_embeddings=args.max_positions,
                             tie_word_embeddings=not args.untie_embeddings)
    try:
        losses = run_sft(args.data, args.out, model_path=args.model, tokenizer_path=args.tokenizer, tiny=tiny,
                         config=config, device=args.device, overwrite=args.overwrite,
                         progress=not args.no_progress, trust_remote_code=args.trust_remote_code).losses
    except (SFTError, DatasetError, TokenizerLoadError, RemoteCodeError, FileNotFoundError) as err:
        print(f"mppo sft: error: {err}", file=sys.stderr)
        return 2
    print(f"mppo sft: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
