"""Task data, prompt datasets and tokenizers.

Bottom floor: imports nothing from the rest of mppo. `mppo.data.tokenizer` imports transformers lazily, so the
task generators and the dataset stay light.
"""
from __future__ import annotations

from mppo.data.dataset import DatasetError, PromptItem, RLDataset
from mppo.data.loader import PromptBatch, PromptLoader, collate
from mppo.data.tasks import TaskGenerationError, generate_countdown, generate_multiply, write_task
from mppo.data.tokenizer import build_local_tokenizer, load_tokenizer

__all__ = [
    "DatasetError",
    "PromptBatch",
    "PromptItem",
    "PromptLoader",
    "RLDataset",
    "TaskGenerationError",
    "build_local_tokenizer",
    "collate",
    "generate_countdown",
    "generate_multiply",
    "load_tokenizer",
    "write_task",
]
