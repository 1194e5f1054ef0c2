"""Score HF model directories on held-out problems with plain transformers, outside mppo (the demo's check).

    python launch/eval_hf.py runs/demo/model runs/demo/hf --data runs/demo/data/test.parquet

For each model: the share of correct answers, greedy and sampled (temperature 1, --samples per problem), where an
answer is correct when the last number in the reply equals the row's reward_model.ground_truth; then one chat
reply to a question outside the task, to show that the model still chats. Uses only transformers, torch, pyarrow.
"""
import argparse
import re

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text):
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def replies(model, tok, questions, sample, max_new_tokens):
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    extra = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **extra)
    return [tok.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True) for row in out]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="HF model directories")
    parser.add_argument("--data", required=True, help="parquet in veRL's row format (e.g. the demo's test split)")
    parser.add_argument("--samples", type=int, default=4, help="sampled replies per problem")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chat", default="Give me two tips for a good night's sleep.")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    rows = pq.read_table(opts.data).to_pylist()
    questions = [r["prompt"][-1]["content"] for r in rows]
    answers = [str(r["reward_model"]["ground_truth"]) for r in rows]
    for path in opts.models:
        torch.manual_seed(opts.seed)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        greedy = replies(model, tok, questions, False, opts.max_new_tokens)
        sampled = replies(model, tok, questions * opts.samples, True, opts.max_new_tokens)
        g = sum(last_number(r) == a for r, a in zip(greedy, answers)) / len(rows)
        s = sum(last_number(r) == a for r, a in zip(sampled, answers * opts.samples)) / len(sampled)
        print(f"{path}: greedy {g:.3f}, sampled {s:.3f} correct on {len(rows)} problems; e.g. "
              f"{questions[0]!r} -> {greedy[0]!r}")
        print(f"    chat: {opts.chat!r} -> {replies(model, tok, [opts.chat], False, 64)[0]!r}")


if __name__ == "__main__":
    main()
