"""Actor, critic and reference workers: log-probs, values and updates through megatron's pipeline schedules.

One forward path: `mppo.workers.pipeline` cuts a batch into micro-batches and runs them through the schedules;
`logprob` (actor, reference) and `critic.compute_response_values` read the response positions of the last
stage's output; `training.TrainLoop` runs the actor's and the critic's updates.
"""
