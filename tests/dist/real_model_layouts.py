"""torchrun script: the real SmolLM2-135M-Instruct (converted from its GGUF) at several TP/PP layouts.

For each `--layout TPxPP` (run in order, in one launch): `mppo convert hf-to-mcore` at that layout, then
`mppo convert mcore-to-hf` back at that layout, compared bitwise with the source safetensors (names, dtypes,
bits, config.json, tokenizer files, generation config); and the response log-probs of the reference worker
(the actor's log-prob path: fused kernel, fp32) against HF transformers' own forward on chat-templated text. Every rank writes
out/rank{R}.json: {case: value}; tests/test_real_model.py asserts on them.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_parallel import compare_hf_dirs  # noqa: E402

QUESTIONS = ["What is 7 * 8? Answer with a number.", "Write one sentence about the sea.",
             "Using the numbers [3, 5], create an equation that equals 15."]
ANSWERS = ["7 * 8 = 56.", "The sea is wide and deep, and it is blue.", "3 * 5 = 15"]


def chat_batch(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The workers' data contract on real chat text: left-padded chat-templated questions ++ right-padded
    answers (each ending in the template's end-of-turn token), veRL's position ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=False) for q in QUESTIONS]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    response_ids = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in ANSWERS]
    P, T = max(map(len, prompt_ids)), max(map(len, response_ids))
    ids = torch.full((len(QUESTIONS), P + T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(QUESTIONS), P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(r)] = torch.tensor(r)
        mask[i, P - len(p):P + len(r)] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    positions[:, P:] = positions[:, P - 1:P] + torch.arange(1, T + 1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, P:].clone(),
            "response_mask": mask[:, P:].float()}


def hf_response_log_probs(hf_dir: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log softmax(logits) at the response tokens from HF transformers (fp32), the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    T = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()[:, -T - 1:-1]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, batch["responses"][..., None]).squeeze(-1)
    return lp * batch["response_mask"]


def run_layout(hf_dir: Path, work: Path, tp: int, pp: int, res: dict, rank: int, batch, want) -> None:
    from mppo.config.schema import MegatronConfig, ModelConfig, RefConfig
    from mppo.models import convert
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.reference import ReferenceWorker

    layout = f"tp{tp}pp{pp}"
    ckpt, back = work / f"ckpt_{layout}", work / f"back_{layout}"
    res[f"{layout}/hf_to_mcore_rc"] = convert.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt),
                                                    "--tp", str(tp), "--pp", str(pp)])
    res[f"{layout}/mcore_to_hf_rc"] = convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back),
                                                    "--tp", str(tp), "--pp", str(pp)])
    if rank == 0:
        res[f"{layout}/roundtrip"] = compare_hf_dirs(hf_dir, back, expect_index=False)
        res[f"{layout}/generation_config_same"] = (
            (back / "generation_config.json").read_bytes() == (hf_dir / "generation_config.json").read_bytes())

    # The reference policy's forward-only log-probs: the actor's code path (fused kernel, torch backend), fp32.
    dims = init_distributed(tp, pp)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              use_distributed_optimizer=False, recompute="none", seed=1)
    ref = ReferenceWorker(ModelConfig(path=str(hf_dir), transformer_impl="local", dtype="fp32"),
                          RefConfig(log_prob_micro_batch_size_per_gpu=2, megatron=megatron), dims, hf_dir,
                          logprob_impl="fused", kernel_backend="torch")
    got = ref.compute_log_prob(batch, temperature=1.0)
    res[f"{layout}/log_probs_vs_hf"] = (got - want).abs().max().item()
    res[f"{layout}/response_tokens"] = int(batch["response_mask"].sum().item())
    del ref
    destroy()


def run_layouts(opts, res: dict) -> None:
    batch = chat_batch(opts.hf)
    want = hf_response_log_probs(opts.hf, batch)
    for layout in opts.layout:
        tp, pp = (int(x) for x in layout.split("x"))
        run_layout(opts.hf, opts.out / "work", tp, pp, res, int(os.environ["RANK"]), batch, want)
        dist.barrier()


def main() -> None:
    def arguments(parser):
        parser.add_argument("--hf", type=Path, required=True, help="the converted SmolLM2 HF directory")
        parser.add_argument("--layout", action="append", required=True, help="TPxPP, e.g. 3x1 (repeatable)")

    rank_main(run_layouts, add_arguments=arguments)


if __name__ == "__main__":
    main()
