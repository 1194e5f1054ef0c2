"""Actor, critic and reference workers: log-probs, values and updates through megatron's pipeline schedules.

`mppo.workers.pipeline` runs micro-batches through the schedules and computes per-token log-probs / values.
"""
