"""Chunked torch fused log-prob/entropy vs the float64 naive reference (values and gradients), memory behaviour,
dispatch and input errors. Triton runs in test_kernels_triton.py, TP=2 in test_kernels_tp.py."""
from __future__ import annotations

import math
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mppo.kernels import fused_linear_logprob_entropy, fused_logprob
from mppo.kernels.reference import naive_linear_logprob_entropy


def make_problem(n, hidden_size, vocab, *, valid=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.7).to(dtype)
    top = valid or vocab
    labels = torch.randint(0, top, (n,), generator=gen)
    labels[0], labels[-1] = 0, top - 1  # vocab edges
    return hidden, weight, labels


def reference_and_fused(hidden, weight, labels, *, backend="torch", temperature=1.0, valid=None, chunk=None,
                        compute_entropy=True, use_lp=True, use_ent=True, seed=1, no_grad_rows=None):
    """(fused results, float64 reference results): log_probs, entropy, grad_hidden, grad_weight of a random
    linear functional of the outputs (so both outputs' gradients are exercised with different weights).
    `no_grad_rows` (a bool mask) gives those tokens zero weight in the loss, as padding tokens get."""
    gen = torch.Generator().manual_seed(seed)
    g_lp = torch.randn(labels.shape[0], generator=gen, dtype=torch.float64).to(hidden.device)
    g_ent = torch.randn(labels.shape[0], generator=gen, dtype=torch.float64).to(hidden.device)
    if no_grad_rows is not None:
        g_lp[no_grad_rows] = 0.0
        g_ent[no_grad_rows] = 0.0

    def run(fn, h, w, **kw):
        h = h.clone().requires_grad_()
        w = w.clone().requires_grad_()
        lp, ent = fn(h, w, labels, temperature=temperature, valid_vocab_size=valid,
                     compute_entropy=compute_entropy, **kw)
        loss = torch.zeros((), dtype=torch.float64)
        if use_lp:
            loss = loss + lp.double() @ g_lp
        if use_ent and ent is not None:
            loss = loss + ent.double() @ g_ent
        loss.backward()
        return lp, ent, h.grad, w.grad

    fused = run(fused_linear_logprob_entropy, hidden, weight, chunk_size=chunk, backend=backend)
    ref = run(naive_linear_logprob_entropy, hidden.double(), weight.double())
    return fused, ref


def assert_close(fused, ref, rtol):
    """Each tensor within rtol of the reference, relative to the reference's largest magnitude."""
    names = ("log_prob", "entropy", "grad_hidden", "grad_weight")
    for name, a, b in zip(names, fused, ref):
        if b is None:
            assert a is None, name
            continue
        scale = b.abs().max().item() + 1e-12
        err = (a.double() - b).abs().max().item() / scale
        assert err < rtol, f"{name}: relative error {err:.2e} >= {rtol:.0e}"


CASES = [
    # n, hidden, vocab, temperature, valid vocab, chunk columns
    (1, 8, 5, 1.0, None, None),
    (37, 16, 101, 1.0, None, None),
    (37, 16, 101, 0.6, None, 13),       # vocab not a multiple of the chunk, temperature < 1
    (64, 32, 256, 1.7, None, 64),       # exact multiples, temperature > 1
    (50, 24, 120, 1.0, 97, 32),         # padded vocab: rows 97..119 never count
    (33, 8, 40, 0.9, 1, None),          # only one real token: log p = 0, entropy = 0
]


@pytest.mark.parametrize("n,hidden_size,vocab,temperature,valid,chunk", CASES)
def test_torch_backend_matches_float64_reference(n, hidden_size, vocab, temperature, valid, chunk):
    hidden, weight, labels = make_problem(n, hidden_size, vocab, valid=valid)
    fused, ref = reference_and_fused(hidden, weight, labels, temperature=temperature, valid=valid, chunk=chunk)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    assert_close(fused, ref, rtol=2e-5)


@pytest.mark.parametrize("dtype,grad_rtol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_row_chunking_when_tokens_exceed_the_row_cap(monkeypatch, dtype, grad_rtol):
    # Long micro-batches are split by rows too: grad_weight then sums over row chunks (in fp32 for bf16).
    monkeypatch.setattr(fused_logprob, "MAX_CHUNK_ROWS", 16)
    hidden, weight, labels = make_problem(45, 16, 70, dtype=dtype)
    fused, ref = reference_and_fused(hidden, weight, labels, temperature=0.8, chunk=32)
    assert_close(fused[:2], ref[:2], rtol=2e-5)
    assert_close((None, None) + fused[2:], (None, None) + ref[2:], rtol=grad_rtol)


@pytest.mark.parametrize("pattern", ["half", "all", "one_output"])
def test_tokens_without_gradient_are_skipped_exactly(pattern):
    # Padding / prompt tokens get zero output gradient; the backward recomputes only the other rows.
    hidden, weight, labels = make_problem(40, 16, 90)
    no_grad_rows = {"half": torch.arange(40) % 2 == 0, "all": torch.ones(40, dtype=torch.bool),
                    "one_output": torch.arange(40) < 30}[pattern]
    fused, ref = reference_and_fused(hidden, weight, labels, temperature=0.9, chunk=32, no_grad_rows=no_grad_rows,
                                     use_ent=pattern != "one_output")
    assert_close(fused, ref, rtol=2e-5)
    assert torch.count_nonzero(fused[2][no_grad_rows]) == 0
    if pattern == "all":
        assert torch.count_nonzero(fused[3]) == 0


def test_float64_inputs_stay_float64():
    hidden, weight, labels = make_problem(20, 8, 30, dtype=torch.float64)
    fused, ref = reference_and_fused(hidden, weight, labels, chunk=7)
    assert fused[0].dtype == torch.float64
    assert_close(fused, ref, rtol=1e-11)


def test_bfloat16_inputs_on_torch_backend():
    hidden, weight, labels = make_problem(30, 16, 90, dtype=torch.bfloat16)
    fused, ref = reference_and_fused(hidden, weight, labels, chunk=40)
    assert fused[2].dtype == torch.bfloat16 and fused[3].dtype == torch.bfloat16
    assert_close(fused[:2], ref[:2], rtol=1e-5)  # statistics are fp32 on the bf16 values
    assert_close((None, None) + fused[2:], (None, None) + ref[2:], rtol=2e-2)  # gradients are rounded to bf16


@pytest.mark.parametrize("use_lp,use_ent,compute_entropy", [(True, False, True), (False, True, True),
                                                            (True, False, False)])
def test_only_some_outputs_in_the_loss(use_lp, use_ent, compute_entropy):
    hidden, weight, labels = make_problem(29, 12, 77)
    fused, ref = reference_and_fused(hidden, weight, labels, temperature=1.2, chunk=20, use_lp=use_lp,
                                     use_ent=use_ent, compute_entropy=compute_entropy)
    if not compute_entropy:
        assert fused[1] is None
        fused, ref = (fused[0], None, *fused[2:]), (ref[0], None, *ref[2:])
    assert_close(fused, ref, rtol=2e-5)


def test_hand_computed_two_token_vocab():
    # logits (2, 0) for one token: p = softmax = (e²/(e²+1), 1/(e²+1)).
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[2.0, 0.0], [0.0, 5.0]])
    lp, ent = fused_linear_logprob_entropy(hidden, weight, torch.tensor([1]), backend="torch")
    p1 = 1 / (math.exp(2) + 1)
    p0 = 1 - p1
    assert lp.item() == pytest.approx(math.log(p1), rel=1e-6)
    assert ent.item() == pytest.approx(-(p0 * math.log(p0) + p1 * math.log(p1)), rel=1e-6)


class _SavedTensorCounter:
    def __init__(self):
        self.numels: list[int] = []

    def pack(self, t):
        self.numels.append(t.numel())
        return t


def test_no_grad_keeps_nothing_and_grad_path_saves_only_inputs_and_row_stats():
    n, h, v = 40, 16, 300
    hidden, weight, labels = make_problem(n, h, v)
    hidden.requires_grad_()
    weight.requires_grad_()
    counter = _SavedTensorCounter()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        with torch.no_grad():
            lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, backend="torch")
        assert counter.numels == [] and lp.grad_fn is None and ent.grad_fn is None
        lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, chunk_size=64, backend="torch")
    # hidden, weight, labels, lse, entropy: nothing of size n × v
    assert sorted(counter.numels) == sorted([n * h, v * h, n, n, n])
    naive = _SavedTensorCounter()
    with torch.autograd.graph.saved_tensors_hooks(naive.pack, lambda t: t):
        naive_linear_logprob_entropy(hidden, weight, labels)
    assert max(naive.numels) >= n * v  # the check above would see a materialised logits tensor


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op produces (to prove no [N × V] tensor is ever created)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_forward_and_backward_never_materialise_full_logits():
    n, h, v, chunk = 64, 8, 2048, 256
    hidden, weight, labels = make_problem(n, h, v)
    hidden.requires_grad_()
    weight.requires_grad_()
    with _LargestAllocation() as probe:
        lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, chunk_size=chunk, backend="torch")
        (lp.sum() + ent.sum()).backward()
    assert probe.largest <= max(n * chunk, v * h)  # one chunk of logits, or the weight's own gradient
    with _LargestAllocation() as naive_probe:
        lp, ent = naive_linear_logprob_entropy(hidden, weight, labels)
        (lp.sum() + ent.sum()).backward()
    assert naive_probe.largest >= n * v


def test_naive_backend_is_the_reference():
    hidden, weight, labels = make_problem(10, 8, 20, valid=17)
    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, valid_vocab_size=17, backend="naive")
    ref_lp, ref_ent = naive_linear_logprob_entropy(hidden, weight, labels, valid_vocab_size=17)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    hidden, weight, labels = make_problem(5, 4, 9)
    import mppo.kernels.backend as backend
    assert backend.resolve_backend("auto", torch.device("cpu")) == "torch"
    assert backend.resolve_backend("auto", torch.device("cuda")) == "triton"
    auto = fused_linear_logprob_entropy(hidden, weight, labels)
    forced = fused_linear_logprob_entropy(hidden, weight, labels, backend="torch")
    assert torch.equal(auto[0], forced[0])


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(backend="cuda-magic"), ValueError, "unknown kernel backend"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(valid_vocab_size=100), ValueError, "valid_vocab_size"),
    (dict(valid_vocab_size=3), ValueError, "labels must be global token ids"),
])
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    hidden, weight, labels = make_problem(6, 4, 9)
    with pytest.raises(error, match=match):
        fused_linear_logprob_entropy(hidden, weight, labels, **{"backend": "torch", **kwargs})


def test_bad_inputs_raise_clear_errors():
    hidden, weight, labels = make_problem(6, 4, 9)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_linear_logprob_entropy(hidden, weight[:, :3], labels)
    with pytest.raises(ValueError, match="flatten"):
        fused_linear_logprob_entropy(hidden.unsqueeze(0), weight, labels)
    with pytest.raises(TypeError, match="share one floating dtype"):
        fused_linear_logprob_entropy(hidden.double(), weight, labels)
    with pytest.raises(TypeError, match="labels must be int64"):
        fused_linear_logprob_entropy(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="labels must be global token ids"):
        fused_linear_logprob_entropy(hidden, weight, labels + 9)


def test_triton_requested_without_triton_names_the_extra(monkeypatch):
    hidden, weight, labels = make_problem(6, 4, 9)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton → ImportError
    with pytest.raises(RuntimeError, match=r"pip install mppo\[gpu\]"):
        fused_linear_logprob_entropy(hidden, weight, labels, backend="triton")


def test_triton_on_cpu_without_interpreter_says_so(monkeypatch):
    hidden, weight, labels = make_problem(6, 4, 9)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_linear_logprob_entropy(hidden, weight, labels, backend="triton")
