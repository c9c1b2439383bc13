"""The CPU stand-ins' attention math (tests/stand_in.py) against independent formulas: the
masks (causal, FlashAttention-3's sliding window) written as one loop over (query, key) pairs,
the softcap, torch autograd for the gradients, and the packed (varlen) layout against the padded
batch. The C++ reference (tests/reference.cpp) has the same checks in tests/test_reference.cpp.
Everything runs on the CPU in float64.
Run: PYTHONPATH=python python3 -m pytest -q tests/test_stand_in.py
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import stand_in  # noqa: E402


def _visible(sq, sk, causal, window):
    """(sq, sk) bool: query i sees key j, FlashAttention-3's rule, one pair at a time."""
    left, right = window
    if causal:
        right = 0
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            lo = i + sk - sq - left if left >= 0 else -10**9
            hi = i + sk - sq + right if right >= 0 else 10**9
            m[i, j] = lo <= j <= hi
    return m


def _direct(q, k, v, scale, causal, window, softcap):
    """out (b, sq, h, d) by torch ops that autograd differentiates; every row must see a key."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_visible(q.shape[1], k.shape[1], causal, window), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# (sq, sk, h, hk, causal, window, softcap): every query row sees at least one key
CASES = [
    (5, 7, 2, 2, False, (-1, -1), 0.0),
    (5, 7, 2, 1, True, (-1, -1), 0.0),
    (6, 9, 3, 1, False, (2, 1), 0.0),
    (6, 6, 2, 2, True, (1, -1), 0.0),
    (5, 7, 2, 2, False, (0, 0), 0.0),    # one key per row: key i + 2
    (5, 7, 2, 1, True, (-1, -1), 0.7),
    (6, 9, 4, 2, False, (3, 2), 30.0),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_cpu_stand_in_matches_autograd(case):
    sq, sk, h, hk, causal, window, softcap = case
    if not _visible(sq, sk, causal, window).any(dim=1).all():
        pytest.skip("a row sees no key: autograd through softmax gives NaN there")
    q, k, v, dout = _randn(2, sq, h, 4, seed=1), _randn(2, sk, hk, 4, seed=2), _randn(2, sk, hk, 4, seed=3), \
        _randn(2, sq, h, 4, seed=4)
    scale = 0.6
    out, lse = stand_in.attention(q, k, v, scale, causal, window, softcap)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    want = _direct(qa, ka, va, scale, causal, window, softcap)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    want.backward(dout)
    for got, ref in zip(stand_in.attention_grads(dout, q, k, v, scale, causal, window, softcap),
                        (qa.grad, ka.grad, va.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_cpu_stand_in_rows_without_keys():
    """A window that leaves rows without keys: out 0, lse +inf, dq 0 for them."""
    q, k, v = _randn(1, 6, 2, 4, seed=5), _randn(1, 3, 2, 4, seed=6), _randn(1, 3, 2, 4, seed=7)
    window = (1, 0)  # query i sees keys i - 4 and i - 3: rows 0-2 see none, row 3 one key
    out, lse = stand_in.attention(q, k, v, None, False, window)
    assert (out[:, :3] == 0).all() and torch.isinf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    dq, _, _ = stand_in.attention_grads(_randn(1, 6, 2, 4, seed=8), q, k, v, None, False, window)
    assert (dq[:, :4] == 0).all() and (dq[:, 4:] != 0).all()  # one key: P = 1 gives dS = 0


def test_cpu_stand_in_varlen_of_equal_lengths_is_the_batch():
    """Three packed sequences of 5 queries and 7 keys give the (3, 5, h, d) batch's values, with
    lse in FlashAttention-3's varlen layout (h, total_q)."""
    q, k, v, dout = _randn(15, 4, 8, seed=9), _randn(21, 2, 8, seed=10), _randn(21, 2, 8, seed=11), \
        _randn(15, 4, 8, seed=12)
    cu_q, cu_k = torch.tensor([0, 5, 10, 15], dtype=torch.int32), torch.tensor([0, 7, 14, 21], dtype=torch.int32)
    kw = dict(causal=True, window=(2, -1), softcap=5.0)
    out, lse = stand_in.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    grads = stand_in.attention_grads_varlen(dout, q, k, v, cu_q, cu_k, **kw)
    bq, bk, bv, bdo = (t.reshape(3, -1, *t.shape[1:]) for t in (q, k, v, dout))
    o, l = stand_in.attention(bq, bk, bv, **kw)
    torch.testing.assert_close(out, o.reshape(15, 4, 8), rtol=0, atol=0)
    torch.testing.assert_close(lse, l.permute(1, 0, 2).reshape(4, 15), rtol=0, atol=0)
    for got, ref in zip(grads, stand_in.attention_grads(bdo, bq, bk, bv, **kw)):
        torch.testing.assert_close(got, ref.reshape(got.shape), rtol=0, atol=0)


def test_cpu_stand_in_varlen_empty_sequences():
    """Lengths (q, k) = (3, 4), (0, 2), (2, 0): no rows for the second, rows without keys (out 0,
    lse +inf) for the third."""
    cu_q, cu_k = torch.tensor([0, 3, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 6, 6], dtype=torch.int32)
    q, k, v = _randn(5, 2, 4, seed=13), _randn(6, 2, 4, seed=14), _randn(6, 2, 4, seed=15)
    out, lse = stand_in.attention_varlen(q, k, v, cu_q, cu_k)
    assert out.shape == (5, 2, 4) and lse.shape == (2, 5)
    assert (out[3:] == 0).all() and torch.isinf(lse[:, 3:]).all() and torch.isfinite(lse[:, :3]).all()
    dq, dk, dv = stand_in.attention_grads_varlen(_randn(5, 2, 4, seed=16), q, k, v, cu_q, cu_k)
    assert dq.shape == q.shape and dk.shape == k.shape and (dq[3:] == 0).all() and (dk[4:6] == 0).all()
