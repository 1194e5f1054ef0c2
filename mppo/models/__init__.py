"""megatron-core models for mppo: HF config -> TransformerConfig + layer spec, actor/critic/ref builders,
HF <-> Megatron weights, dist checkpoints and `mppo convert`.

Modules: hf_config (read config.json), spec (TE, SDPA or local layers), attention (SDPA core attention), vocab
(padding helpers), builders (build_gpt_model), weights (load_hf_weights, iter_hf_weights, bucketed,
save_hf_checkpoint), checkpoint (save/load_model_checkpoint), convert (`mppo convert` main).
"""
