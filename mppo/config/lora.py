"""LoRA's config: which projections `actor_rollout_ref.model.lora.target_modules` / `exclude_modules` name, and the
checks of the `lora` section (one ConfigError line each). Pure Python: the adapters are mppo.models.lora.

Names are veRL's (Megatron) ones or HF PEFT's: a megatron linear stands for the HF projections fused into it
(`linear_qkv` = q_proj + k_proj + v_proj, `linear_fc1` = gate_proj + up_proj), and `all-linear` for all of them.
Adapters are per HF projection, so `q_proj` alone adapts only the q part of the fused linear_qkv, exactly as PEFT
adapts HF's q_proj.
"""
from __future__ import annotations

from mppo.config.schema import ConfigError, MppoConfig

LORA = "actor_rollout_ref.model.lora"
# megatron linear -> the HF projections it fuses, in megatron's fused order
MEGATRON_LINEARS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_PROJECTIONS: tuple[str, ...] = tuple(p for projs in MEGATRON_LINEARS.values() for p in projs)
ALL_LINEAR = "all-linear"
TARGET_NAMES = (*MEGATRON_LINEARS, *HF_PROJECTIONS, ALL_LINEAR)


def _projections(key: str, names: list[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        if name == ALL_LINEAR:
            out.update(HF_PROJECTIONS)
        elif name in MEGATRON_LINEARS:
            out.update(MEGATRON_LINEARS[name])
        elif name in HF_PROJECTIONS:
            out.add(name)
        else:
            raise ConfigError(f"{key} = {name!r} is not a module LoRA can adapt; choose from: "
                              f"{', '.join(TARGET_NAMES)}")
    return out


def lora_projections(target_modules: list[str], exclude_modules: list[str]) -> tuple[str, ...]:
    """The HF projections that get adapters (in HF_PROJECTIONS order): the targets minus the exclusions."""
    chosen = _projections(f"{LORA}.target_modules", list(target_modules))
    chosen -= _projections(f"{LORA}.exclude_modules", list(exclude_modules))
    return tuple(p for p in HF_PROJECTIONS if p in chosen)


def lora_enabled(cfg: MppoConfig) -> bool:
    """Whether the actor trains LoRA adapters on a frozen base (lora.rank > 0) instead of its full weights."""
    return cfg.actor_rollout_ref.model.lora.rank > 0


def adapter_sync(cfg: MppoConfig) -> bool:
    """Whether each sync pushes only the adapters to the engine (lora.merge=false; SGLang's LoRA support holds the
    base), instead of base + adapters merged."""
    return lora_enabled(cfg) and not cfg.actor_rollout_ref.model.lora.merge


def check_lora(cfg: MppoConfig) -> None:
    """One ConfigError line for a LoRA setting mppo cannot run (the model's type is checked at start-up, by
    mppo.preflight, which reads its config.json)."""
    lora = cfg.actor_rollout_ref.model.lora
    if lora.rank < 0:
        raise ConfigError(f"{LORA}.rank = {lora.rank}: must be >= 0; 0 turns LoRA off, e.g. 16 or 32 for adapters")
    projections = lora_projections(lora.target_modules, lora.exclude_modules)
    if lora.rank == 0:
        return
    if not projections:
        raise ConfigError(f"{LORA}.target_modules = {list(lora.target_modules)} minus exclude_modules = "
                          f"{list(lora.exclude_modules)} leaves nothing to adapt; target at least one module")
    if lora.alpha <= 0:
        raise ConfigError(f"{LORA}.alpha = {lora.alpha}: must be > 0 (the adapter scale is alpha / rank)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"{LORA}.dropout = {lora.dropout}: must be in [0, 1)")
    if not lora.merge and cfg.actor_rollout_ref.rollout.name != "sglang":
        raise ConfigError(f"{LORA}.merge = false pushes only the adapters, to SGLang's LoRA support; the "
                          f"{cfg.actor_rollout_ref.rollout.name!r} engine takes merged weights: set merge=true or "
                          "actor_rollout_ref.rollout.name=sglang")
    if not lora.merge and not cfg.actor_rollout_ref.hybrid_engine:
        raise ConfigError(f"{LORA}.merge = false with actor_rollout_ref.hybrid_engine=false: adapter-only sync "
                          "across the separate placement is not built; set merge=true")


EXPERT_PROJECTIONS = MEGATRON_LINEARS["linear_fc1"] + MEGATRON_LINEARS["linear_fc2"]


def check_lora_model(cfg: MppoConfig, model_type: str, is_moe: bool) -> None:
    """LoRA on a model mppo cannot adapt stops at start-up in one line (mppo.preflight.check_models calls this with
    the actor's config.json facts). On a MoE model the MLP projections adapt every expert (whole experts:
    expert-TP 1), and the adapters go to the engine merged."""
    lora = cfg.actor_rollout_ref.model.lora
    if not (lora_enabled(cfg) and is_moe):
        return
    adapted = [p for p in lora_projections(lora.target_modules, lora.exclude_modules) if p in EXPERT_PROJECTIONS]
    if not adapted:
        return
    megatron = cfg.actor_rollout_ref.actor.megatron
    etp = megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size
    if etp > 1:
        raise ConfigError(f"{LORA} on the experts of a {model_type} (MoE) model ({', '.join(adapted)}) is built "
                          f"for whole experts, and expert-TP is {etp}: set actor_rollout_ref.actor.megatron."
                          "expert_tensor_parallel_size=1, or leave gate_proj, up_proj, down_proj out of "
                          "lora.target_modules")
    if not lora.merge:
        raise ConfigError(f"{LORA}.merge = false with adapters on the experts of a {model_type} (MoE) model: "
                          "adapter-only sync of MoE experts is not built (SGLang's LoRA support adapts dense "
                          "linears); set merge=true")
