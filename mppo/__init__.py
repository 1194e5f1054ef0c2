"""mppo: Megatron-style PPO/GRPO trainer."""
__version__ = "0.1.0"
