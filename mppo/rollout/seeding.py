"""Per-sample seeds, derived from what a sample IS (run seed, step, global prompt index, sample index).

Never from the rank, the batch or Python's hash() (salted per process): so the same run seed gives the same
rollouts whatever the DP/TP layout or batching, and a resumed run samples what the uninterrupted one would have.
"""
from __future__ import annotations

import hashlib
import struct

# blake2b personalisation (<= 16 bytes): keeps these seeds apart from other hashes of the same integers.
_DOMAIN = b"mppo.rollout"
_INT63_MASK = (1 << 63) - 1  # non-negative and fits int64: SGLang's sampling_seed and torch.Generator accept it


def stable_hash63(*values: int) -> int:
    """A 63-bit hash of signed 64-bit integers, identical on every machine, process and Python version."""
    payload = struct.pack(f"<{len(values)}q", *values)
    digest = hashlib.blake2b(payload, digest_size=8, person=_DOMAIN).digest()
    return int.from_bytes(digest, "little") & _INT63_MASK


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample's random stream (see the module docstring)."""
    return stable_hash63(run_seed, step, prompt_index, sample_index)
