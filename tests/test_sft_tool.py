"""`mppo sft --tool-fraction`: a tool demonstration is token for token what the multi-turn agent loop builds when
the model writes the same turns (the tool turns out of the loss), the loss counts only the model's tokens (against
a loss computed by hand), and the demonstrations earn the full countdown reward with real calculator calls."""
from __future__ import annotations

import math

import pytest
import torch

from mppo import sft
from mppo.data import RLDataset, build_local_tokenizer, write_task
from mppo.rewards import default_compute_score
from mppo.rollout.agent_loop import run_agent_loop
from mppo.rollout.base import RolloutResponse, SamplingParams
from mppo.rollout.tools import parse_tool_calls
from mppo.sft_tool import build_tool_examples, tool_call_text, tool_demonstration

TINY = sft.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                         max_position_embeddings=512)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [tool_call_text("(9 - 5) * 3"), "0.6 is not 12. (9 - 5) * 3 = 12, so <answer> (9 - 5) * 3 </answer>",
             "Using the numbers [9, 5, 3], create an equation that equals 12."] * 20
    tokenizer = build_local_tokenizer(texts, 500, tmp_path_factory.mktemp("tok"))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # the agent loop stops a turn at the call's last token
    return tokenizer


class TurnScript:
    """A rollout engine whose turn k is texts[k] (EOS after the last): the model writing the demonstration."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tok, self.texts = tokenizer, texts

    def generate(self, prompts, sampling, *, step, prompt_offsets=None):
        out = []
        for ids, offset in zip(prompts, prompt_offsets):
            turn = ids.count(self.tok.convert_tokens_to_ids("</tool_call>"))
            tokens = self.tok.encode(self.texts[turn], add_special_tokens=False)
            if turn == len(self.texts) - 1:
                tokens.append(self.tok.eos_token_id)
            out.append(RolloutResponse(offset, 0, tokens, [-1.0] * len(tokens), "stop"))
        return out


def test_demonstration_is_the_agent_loop_conversation(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Using the numbers [9, 5, 3], create an equation "
                                       "that equals 12."}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    example = tool_demonstration(tok, prompt_ids, ["(9 / 5) / 3", "(9 - 5) * 3"], "(9 - 5) * 3", 12)
    turns = [tool_call_text("(9 / 5) / 3"), "0.6 is not 12. " + tool_call_text("(9 - 5) * 3"),
             "(9 - 5) * 3 = 12, so <answer> (9 - 5) * 3 </answer>"]
    (rollout,) = run_agent_loop(TurnScript(tok, turns), [prompt_ids], SamplingParams(
        n=1, max_new_tokens=256, stop_token_ids=(tok.eos_token_id,)), step=0, prompt_offsets=[0], tokenizer=tok,
        max_assistant_turns=3, max_response_length=400, tool_timeout_s=5.0)
    assert rollout.num_tool_calls == 2  # the real calculator answered 0.6 then 12 in the loop too
    assert example.input_ids[:example.prompt_length] == prompt_ids
    assert example.input_ids[example.prompt_length:] == rollout.token_ids
    assert list(example.loss_mask) == rollout.loss_mask
    # the tokens out of the loss are exactly the two tool turns of the chat template
    masked = [t for t, m in zip(rollout.token_ids, example.loss_mask) if not m]
    assert tok.decode(masked) == ("<|im_end|>\n<|im_start|>tool\n0.6<|im_end|>\n<|im_start|>assistant\n" * 1 +
                                  "<|im_end|>\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n")


def test_loss_counts_only_the_model_turns(tok):
    prompt_ids = tok.encode("<|im_start|>user\nreach 12<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    pair = [tool_demonstration(tok, prompt_ids, ["(9 - 5) * 3"], "(9 - 5) * 3", 12),
            tool_demonstration(tok, prompt_ids, ["(9 / 5) / 3", "(9 - 5) * 3"], "(9 - 5) * 3", 12)]
    model = sft.init_tiny_model(tok, TINY, seed=1)
    with torch.no_grad():
        got = sft.response_loss(model, sft.collate(pair, tok.pad_token_id)).item()
        nll = []
        for example in pair:
            ids = example.input_ids
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
            # by hand, from the text: after a "</tool_call>" the tokens up to and including the next
            # "<|im_start|>assistant\n" are the tool turn (no loss); every other response token has loss
            in_tool_turn = False
            for t in range(example.prompt_length, len(ids)):
                if not in_tool_turn:
                    nll.append(-log_probs[t - 1, ids[t]].item())
                text = tok.decode(ids[example.prompt_length:t + 1])
                if in_tool_turn and text.endswith("<|im_start|>assistant\n"):
                    in_tool_turn = False
                elif text.endswith("</tool_call>"):
                    in_tool_turn = True
    assert math.isclose(got, sum(nll) / len(nll), rel_tol=1e-5)
    assert sum(sum(e.loss_mask) for e in pair) == len(nll)


def test_tool_examples_earn_the_full_reward_with_real_calls(tok, tmp_path):
    write_task("countdown", tmp_path, train_size=40, test_size=1, seed=0, template="tool", num_operands=3,
               max_number=9, max_target=40)
    dataset = RLDataset(tmp_path / "train.parquet", tok, max_prompt_length=400)
    examples = build_tool_examples(dataset, tok, 300, tool_fraction=0.5, retry_fraction=0.5, seed=0)
    tool_rows = [i for i, e in enumerate(examples) if e.loss_mask is not None]
    assert 10 <= len(tool_rows) <= 30  # about half of 40
    retries = 0
    for i in tool_rows:
        item, example = dataset[i], examples[i]
        text = tok.decode(example.input_ids[:-1], skip_special_tokens=False)
        assert default_compute_score(item.data_source, text, item.ground_truth) == 1.0, text
        calls = parse_tool_calls(text[len(item.raw_prompt):])
        assert calls and all(c.name == "calculator" and not c.error for c in calls)
        assert calls[-1].arguments["expression"] == item.extra_info["solution"]
        retries += len(calls) == 2
    assert retries > 0
    # direct answers: no mask, no call; with tool_fraction 0 the SFT examples of mppo.sft are unchanged
    assert all(parse_tool_calls(tok.decode(examples[i].input_ids[examples[i].prompt_length:])) == []
               for i in range(40) if i not in tool_rows)
    none = build_tool_examples(dataset, tok, 300, tool_fraction=0.0, seed=0)
    assert [e.input_ids for e in none] == [e.input_ids for e in sft.build_examples(dataset, tok, 300)]
    with pytest.raises(sft.SFTError, match="tool_fraction"):
        build_tool_examples(dataset, tok, 300, tool_fraction=1.5)
    with pytest.raises(sft.SFTError, match="max_response_length"):
        build_tool_examples(dataset, tok, 10, tool_fraction=1.0)


def test_multiply_tool_examples_call_a_times_b_and_copy_its_product(tok, tmp_path):
    write_task("multiply", tmp_path, train_size=30, test_size=1, seed=0, template="tool", digits=2)
    dataset = RLDataset(tmp_path / "train.parquet", tok, max_prompt_length=400)
    examples = build_tool_examples(dataset, tok, 300, tool_fraction=0.5, seed=0)
    tool_rows = [i for i, e in enumerate(examples) if e.loss_mask is not None]
    assert 5 <= len(tool_rows) <= 25
    for i, example in enumerate(examples):
        item = dataset[i]
        text = tok.decode(example.input_ids[:-1], skip_special_tokens=False)
        assert default_compute_score(item.data_source, text, item.ground_truth) == 1.0, text
        calls = parse_tool_calls(text[len(item.raw_prompt):])
        if i in tool_rows:
            assert [c.name for c in calls] == ["calculator"]
            a, b = (int(x) for x in calls[0].arguments["expression"].split(" * "))
            assert a * b == item.ground_truth and f"What is {a} * {b}?" in item.raw_prompt
        else:
            assert calls == []
    with pytest.raises(sft.SFTError, match="tool-retry-fraction"):  # a product has no wrong candidate to check
        build_tool_examples(dataset, tok, 300, tool_fraction=0.5, retry_fraction=0.5)
    with pytest.raises(sft.SFTError, match="solution-noise"):
        build_tool_examples(dataset, tok, 300, tool_fraction=0.5, solution_noise=0.5)


def test_cli_tool_warm_up_runs(tok, tmp_path, capsys):
    write_task("countdown", tmp_path / "data", train_size=8, test_size=1, seed=0, template="tool", num_operands=2,
               max_number=9, max_target=20)
    tok.save_pretrained(tmp_path / "tok")
    from mppo.cli import main as cli_main
    code = cli_main(["sft", "--data", str(tmp_path / "data" / "train.parquet"), "--out", str(tmp_path / "out"),
                     "--init-tiny", "--tokenizer", str(tmp_path / "tok"), "--hidden", "32", "--layers", "1",
                     "--max-positions", "512", "--steps", "2", "--batch-size", "4", "--max-response-length", "300",
                     "--max-prompt-length", "400", "--tool-fraction", "0.5", "--no-progress"])
    assert code == 0 and "2 steps" in capsys.readouterr().out
