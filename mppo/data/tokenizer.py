"""A local byte-level BPE tokenizer (no downloads) for tests and the CPU demo, and loading tokenizers.

The tokenizer is trained with Qwen2's own pipeline (NFC normalizer, Qwen2's split regex, byte-level BPE), so it
encodes the same whether loaded as PreTrainedTokenizerFast or as the Qwen2Tokenizer that AutoTokenizer picks for a
qwen2 model. Qwen2's regex splits numbers into single digits, and merges never cross that split: every digit is
one token, which keeps arithmetic tasks learnable for tiny models.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from mppo.errors import UserError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)  # ids 0..3 in this order

# ChatML, as Qwen's instruct models use (without Qwen's default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# transformers' Qwen2Tokenizer uses this split regex; the same pipeline here keeps ids identical either way.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


class TokenizerLoadError(UserError, ValueError):
    """A tokenizer directory cannot be loaded; the message names the path."""


def build_local_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike[str]) -> Any:
    """Train a byte-level BPE on `texts`, save it to `out_dir` as an HF tokenizer directory, and return it
    (a transformers.PreTrainedTokenizerFast). `vocab_size` counts the 256 byte tokens and the special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + {len(SPECIAL_TOKENS)} special "
                         f"tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHAT_TEMPLATE
    out_dir = os.fspath(out_dir)
    fast.save_pretrained(out_dir)
    _pin_tokenizer_class(out_dir)
    return load_tokenizer(out_dir)


def _pin_tokenizer_class(out_dir: str) -> None:
    """Record the class explicitly so AutoTokenizer does not substitute a model-specific one."""
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def load_tokenizer(path: str | os.PathLike[str], trust_remote_code: bool = False, *,
                   flag: str = "actor_rollout_ref.model.trust_remote_code=true") -> Any:
    """Load a tokenizer directory: PreTrainedTokenizerFast for one made by `build_local_tokenizer` (AutoTokenizer
    would pick Qwen2Tokenizer for a qwen2 model directory and may rebuild its pipeline), AutoTokenizer otherwise.
    Never downloads. A tokenizer that needs its own code (mppo.models.remote_code) loads only with
    `trust_remote_code`, and otherwise stops with one line (RemoteCodeError) naming `flag`, the setting that
    allows it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from mppo.models.remote_code import check_remote_code

    path = os.fspath(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise TokenizerLoadError(f"no tokenizer in {path!r} (no tokenizer_config.json or tokenizer.json); give "
                                 "the directory of an HF tokenizer, e.g. one written by build_local_tokenizer")
    tokenizer_class = None
    if os.path.isfile(config_path):
        with open(config_path) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    if tokenizer_class == "PreTrainedTokenizerFast":
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    check_remote_code(path, trust_remote_code, flag=flag)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        # a custom-code case the check above does not know: transformers' own many-line message, in one line
        raise TokenizerLoadError(f"the tokenizer in {path!r} needs its own code ({' '.join(str(err).split())[:200]}); "
                                 f"set {flag} for a tokenizer you trust"
                                 ) from None
