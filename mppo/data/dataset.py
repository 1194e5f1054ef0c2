"""Prompts for RL from parquet files in veRL's row format (see mppo.data.tasks for the columns).

Every problem with the data is reported when the dataset is built, naming the file, the row and the fix: a
missing or unreadable file, a row without a prompt, data_source or reward_model.ground_truth, an empty dataset,
and (as configured) prompts longer than max_prompt_length. A row's `reward_model.style` other than "rule" (e.g.
"natural", see mppo.rewards.answer) is handed to the reward function as `extra_info["reward_style"]`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from mppo.errors import UserError

logger = logging.getLogger(__name__)

MAKE_DATA_HINT = ("make task data with `mppo data countdown --out DIR` (or `mppo data multiply --out DIR`), which "
                  "writes DIR/train.parquet and DIR/test.parquet")


class DatasetError(UserError, ValueError):
    """The data cannot be used as given; the message names the file, the row and the fix."""


@dataclass(frozen=True)
class PromptItem:
    input_ids: list[int]  # the prompt's token ids, unpadded
    raw_prompt: str  # the prompt text that was tokenized (chat template applied when configured)
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # position in this dataset: unique, usable as a prompt id (e.g. a GRPO group)


@dataclass(frozen=True)
class _Row:
    file: str
    row: int  # row number within the file, for error messages
    prompt: Any
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]


def _read_rows(path: str, prompt_key: str) -> list[_Row]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} does not exist; {MAKE_DATA_HINT}, then point "
                                "data.train_files / data.val_files at those files")
    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"cannot read data file {path!r} as parquet ({type(err).__name__}: {err}); "
                           f"{MAKE_DATA_HINT}") from err
    rows = []
    for i, record in enumerate(records):
        where = f"row {i} of {path!r}"
        prompt = record.get(prompt_key)
        if prompt is None or (not isinstance(prompt, str) and len(prompt) == 0):
            raise DatasetError(f"{where} has no {prompt_key!r} (data.prompt_key); every row needs a prompt: chat "
                               "messages [{'role': 'user', 'content': ...}] or a string")
        reward_model = record.get("reward_model")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise DatasetError(f"{where} has no reward_model.ground_truth; every row needs "
                               "{'reward_model': {'style': 'rule', 'ground_truth': ...}} for its reward")
        data_source = record.get("data_source")
        if not isinstance(data_source, str) or not data_source:
            raise DatasetError(f"{where} has no data_source; it selects the reward function (e.g. 'countdown')")
        extra_info = record.get("extra_info") or {}
        if not isinstance(extra_info, dict):
            raise DatasetError(f"{where}: extra_info must be a mapping such as {{'split': 'train', 'index': 0}}, "
                               f"got {type(extra_info).__name__}")
        extra_info = dict(extra_info)
        style = reward_model.get("style")
        if isinstance(style, str) and style not in ("", "rule"):  # "rule" is the scorers' default
            extra_info.setdefault(REWARD_STYLE_KEY, style)
        rows.append(_Row(path, i, prompt, data_source, reward_model["ground_truth"], extra_info))
    return rows


# A row's reward_model.style other than "rule" reaches the reward function as extra_info[REWARD_STYLE_KEY]
# (veRL's compute_score signature has no other per-row channel); mppo.rewards.answer documents the styles.
REWARD_STYLE_KEY = "reward_style"

# A prompt that already opens the assistant's turn (TinyZero's rows carry their own template) is used as written
# under apply_chat_template="auto". The same markers as mppo.rewards.answer (same floor, so not imported).
ASSISTANT_MARKERS = ("Assistant:", "<|im_start|>assistant", "<|start_header_id|>assistant")


class RLDataset:
    """Tokenized prompts with what their reward needs.

    apply_chat_template: True: always (the tokenizer must have one); False: never (a prompt must be a string or
        a single message, used as written); "auto": when the tokenizer has a chat template and the prompt does not
        already open the assistant's turn ("Assistant:" or "<|im_start|>assistant", as TinyZero-style rows do).
    filter_overlong_prompts: True: drop prompts longer than max_prompt_length tokens and log how many; False or
        "error": refuse the data, naming the first such row. Either way every prompt is tokenized up front, so a
        problem stops the run before it starts.
    """

    def __init__(self, files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], tokenizer: Any, *,
                 prompt_key: str = "prompt", max_prompt_length: int = 1024,
                 apply_chat_template: bool | Literal["auto"] = "auto",
                 filter_overlong_prompts: bool | Literal["error"] = True) -> None:
        if apply_chat_template not in (True, False, "auto"):
            raise ValueError(f"apply_chat_template must be true, false or 'auto', got {apply_chat_template!r}")
        if filter_overlong_prompts not in (True, False, "error"):
            raise ValueError(f"filter_overlong_prompts must be true, false or 'error', got "
                             f"{filter_overlong_prompts!r}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        if apply_chat_template is True and not self.has_chat_template:
            raise DatasetError("apply_chat_template is true but the tokenizer has no chat template; set it to false "
                               "(prompts used as written) or use a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.apply_chat_template = apply_chat_template

        paths = [os.fspath(files)] if isinstance(files, (str, os.PathLike)) else [os.fspath(f) for f in files]
        if not paths:
            raise DatasetError(f"no data files given; {MAKE_DATA_HINT}")
        self._rows = [row for path in paths for row in _read_rows(path, prompt_key)]
        if not self._rows:
            raise DatasetError(f"the dataset {paths} has no rows; {MAKE_DATA_HINT}")
        self._texts: list[str] = []
        self._ids: list[list[int]] = []
        self.num_dropped_overlong = 0  # prompts dropped by filter_overlong_prompts=True, for the run's log/metrics
        self._tokenize_all(drop_overlong=filter_overlong_prompts is True)

    def _render(self, row: _Row) -> str:
        prompt = row.prompt
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise DatasetError(f"row {row.row} of {row.file!r}: the prompt must be a string or a list of "
                                   "{'role': ..., 'content': str} messages")
        if self._use_template(messages):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if len(messages) != 1:
            raise DatasetError(f"row {row.row} of {row.file!r} has {len(messages)} messages; without a chat template "
                               "a prompt must be one message: set data.apply_chat_template to true (a tokenizer "
                               "with a chat template) or store a single message")
        return messages[0]["content"]

    def _use_template(self, messages: list[dict[str, Any]]) -> bool:
        if self.apply_chat_template != "auto":
            return bool(self.apply_chat_template)
        opens_assistant = any(marker in m["content"] for m in messages for marker in ASSISTANT_MARKERS)
        return self.has_chat_template and not opens_assistant

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _tokenize_all(self, drop_overlong: bool) -> None:
        texts = [self._render(row) for row in self._rows]
        ids = self._encode(texts)
        keep = [i for i, seq in enumerate(ids) if len(seq) <= self.max_prompt_length]
        dropped = len(ids) - len(keep)
        if dropped and not drop_overlong:
            first = next(i for i, seq in enumerate(ids) if len(seq) > self.max_prompt_length)
            row = self._rows[first]
            raise DatasetError(f"{dropped} of {len(ids)} prompts are longer than max_prompt_length="
                               f"{self.max_prompt_length} tokens, the first in row {row.row} of {row.file!r} "
                               f"({len(ids[first])} tokens); raise data.max_prompt_length or set "
                               "data.filter_overlong_prompts=true to drop such prompts")
        if dropped == len(ids):
            raise DatasetError(f"all {len(ids)} prompts are longer than max_prompt_length={self.max_prompt_length} "
                               "tokens, so the dataset is empty; raise data.max_prompt_length")
        self.num_dropped_overlong = dropped
        if dropped:
            logger.warning("dropped %d of %d prompts longer than max_prompt_length=%d tokens", dropped, len(ids),
                           self.max_prompt_length)
        self._rows = [self._rows[i] for i in keep]
        self._texts = [texts[i] for i in keep]
        self._ids = [ids[i] for i in keep]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> PromptItem:
        if not 0 <= index < len(self._rows):
            raise IndexError(f"dataset index {index} out of range for {len(self._rows)} prompts")
        row = self._rows[index]
        return PromptItem(input_ids=list(self._ids[index]), raw_prompt=self._texts[index],
                          data_source=row.data_source, ground_truth=row.ground_truth, extra_info=row.extra_info,
                          index=index)
