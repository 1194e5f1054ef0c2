"""A lone process (no torchrun environment): world of one, layout errors, CPU patches, a forward pass.

Run as a plain `python` subprocess by tests/test_parallel_single_process.py; prints one JSON line.
"""
from __future__ import annotations

import json
import os

import torch


def main() -> None:
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    import torch.distributed as dist

    from mppo.parallel import ParallelLayoutError, cpu_compat, destroy, init_distributed

    res: dict = {}
    try:
        init_distributed(2, 1)
    except ParallelLayoutError as err:
        res["tp2_error"] = str(err)
    res["initialized_after_error"] = dist.is_initialized()  # the check comes before any group
    res["installed_before"] = cpu_compat.installed()
    dims = init_distributed(1, 1)
    res["dims"] = [dims.world, dims.rank, dims.tp, dims.pp, dims.dp, dims.backend, str(dims.device)]
    res["installed"] = cpu_compat.installed()
    try:
        init_distributed(1, 1)
    except RuntimeError as err:
        res["twice_error"] = str(err)

    from megatron.core import tensor_parallel

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config

    args = read_hf_config({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "vocab_size": 300})
    model = build_gpt_model(args, dims)[0]
    logits = model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], None)
    res["logits_shape"] = list(logits.shape)
    # RNG tracker seeded by init_distributed: forking the model-parallel stream is repeatable
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    with tracker.fork():
        a = torch.rand(3)
    tracker.set_states(states)
    with tracker.fork():
        b = torch.rand(3)
    res["fork_repeatable"] = bool(torch.equal(a, b))
    ref = build_gpt_model(args, dims, role="ref")[0]
    res["ref_frozen"] = not ref.training and not any(p.requires_grad for p in ref.parameters())
    try:
        build_gpt_model(args, dims, role="reward")
    except ValueError as err:
        res["bad_role_error"] = str(err)
    destroy(process_group=True)
    res["initialized_after_destroy"] = dist.is_initialized()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
