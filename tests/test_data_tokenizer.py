"""The local byte-level BPE tokenizer: offline, digits one per token, special tokens, stable ids on reload."""
from __future__ import annotations

import json

import pytest

from mppo.data.tasks import countdown_prompt, generate_countdown
from mppo.data.tokenizer import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    TokenizerLoadError,
    build_local_tokenizer,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    texts = [countdown_prompt(p.target, p.numbers) + f" </think>\n<answer> {p.solution} </answer>"
             for p in generate_countdown(300, seed=0)]
    build_local_tokenizer(texts + ["12345678901234567890 " * 20], vocab_size=512, out_dir=out)
    return out


def test_digits_are_single_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    for number in ["7", "42", "1000", "9876543210", "31415926535897932384"]:
        ids = tok(number, add_special_tokens=False)["input_ids"]
        assert [tok.decode([i]) for i in ids] == list(number)


def test_special_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)}
    assert len(set(ids.values())) == 4
    assert tok.eos_token_id == ids[EOS_TOKEN] and tok.pad_token_id == ids[PAD_TOKEN]
    text = f"{IM_START}assistant\n<answer> 3 </answer>{IM_END}{EOS_TOKEN}"
    encoded = tok(text, add_special_tokens=False)["input_ids"]
    assert encoded[0] == ids[IM_START] and encoded[-2:] == [ids[IM_END], ids[EOS_TOKEN]]
    assert tok.decode(encoded) == text
    assert tok.decode(encoded, skip_special_tokens=True) == "assistant\n<answer> 3 </answer>"
    assert len(tok) <= 512


def test_any_text_round_trips(tok_dir):
    tok = load_tokenizer(tok_dir)
    for text in ["héllo wörld", "5 × 7 − 3 ÷ 2", "你好, 世界", "tabs\tand\nnewlines  ", "emoji 🙂"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_ids_survive_a_qwen2_model_dir(tok_dir):
    """The notes' pitfall: for a qwen2 model directory AutoTokenizer builds Qwen2Tokenizer; ids must not change."""
    from transformers import AutoTokenizer

    text = countdown_prompt(24, [4, 6, 1]) + " <answer> 4 * 6 * 1 </answer>"
    expected = load_tokenizer(tok_dir)(text, add_special_tokens=False)["input_ids"]
    (tok_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    try:
        assert AutoTokenizer.from_pretrained(tok_dir)(text, add_special_tokens=False)["input_ids"] == expected
        assert load_tokenizer(tok_dir)(text, add_special_tokens=False)["input_ids"] == expected
    finally:
        (tok_dir / "config.json").unlink()


def test_bad_inputs(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no tokenizer in"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        build_local_tokenizer(["abc"], vocab_size=100, out_dir=tmp_path / "t")
