"""GPU tests of the PyTorch binding (python/flash3) against an fp64 reference.

Tolerance (FlashAttention-3's rule): max |flash3 - fp64| <= 2 * max |plain - fp64| + 1e-5, where
`plain` is the same attention done by torch in the input dtype (scores, softmax, P, PV in dtype).
Run on the GPU machine: python3 -m pytest -q tests/test_torch.py
"""
import math
import os
import re
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402

_ok, _why = flash3.hopper_available()
_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not (_hopper and _ok), reason=f"needs a Hopper GPU and libflash3.so: {_why}")

DTYPES = [torch.bfloat16, torch.float16]
HDIMS = [64, 128, 256]
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
SHAPES = [
    (1, 1, 1, 4, 4),
    (2, 17, 17, 4, 2),
    (1, 128, 128, 4, 4),
    (2, 129, 129, 4, 1),
    (1, 1000, 1000, 2, 2),
    (2, 128, 1000, 4, 2),   # seqlen_q < seqlen_k
    (1, 1000, 129, 4, 4),   # seqlen_q > seqlen_k: causal leaves rows with no visible key
    (1, 1, 1000, 8, 1),     # decode step, MQA
    (2, 17, 1, 2, 2),
]


def visible(sq, sk, device):
    """Bottom-right causal mask: key j is visible to query i iff j <= i + sk - sq."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return j <= i + sk - sq


def attention(q, k, v, scale, causal, upcast):
    """(out (b, sq, h, d), lse (b, h, sq)). upcast: in fp64; else plainly in the input dtype."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if causal:
        s = s.masked_fill(~visible(q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(s.double(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(v.dtype)  # rows with no visible key: 0
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def check(q, k, v, causal, scale=None, out=None, lse=None):
    """Compares (out, lse) from flash3 with the fp64 reference under the tolerance rule."""
    if out is None:
        out, lse = flash3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref, ref_lse = attention(q, k, v, s, causal, upcast=True)
    plain, _ = attention(q, k, v, s, causal, upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in out"
    err = (out.double() - ref).abs().max().item()
    plain_err = (plain.double() - ref).abs().max().item()
    assert err <= 2 * plain_err + 1e-5, f"max abs err {err:.3e} > 2 * plain {plain_err:.3e} + 1e-5"
    b, sq, h, _ = q.shape
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    rows = torch.ones(sq, dtype=torch.bool, device=q.device)
    if causal:
        rows = visible(sq, k.shape[1], q.device).any(dim=1)
    lse_err = (lse.double() - ref_lse)[..., rows].abs().max().item() if rows.any() else 0.0
    assert lse_err <= 1e-3, f"lse max abs err {lse_err:.3e}"
    if not rows.all():  # the library's contract for rows that see no key: out 0, lse +inf
        assert (out[:, ~rows] == 0).all()
        assert torch.isposinf(lse[..., ~rows]).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_matches_fp64(dtype, hdim, causal, shape):
    b, sq, sk, h, hk = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((hdim, causal) + shape) % 2**31)
    q, k, v = randn((b, sq, h, hdim), dtype, gen), randn((b, sk, hk, hdim), dtype, gen), randn((b, sk, hk, hdim), dtype, gen)
    out, lse = flash3.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check(q, k, v, causal, out=out, lse=lse)
    # every element written: same call into NaN-poisoned buffers gives the same bits
    out2 = torch.full_like(q, float("nan"))
    lse2 = torch.full((b, h, sq), float("nan"), device="cuda")
    flash3.forward_into(q, k, v, out2, lse2, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("hdim", HDIMS)
def test_strided_inputs_and_scale(hdim):
    gen = torch.Generator(device="cuda").manual_seed(hdim)
    b, s, h = 2, 300, 4
    q = randn((b, h, s, hdim), torch.bfloat16, gen).transpose(1, 2)           # (b, s, h, d) view of bhsd
    kv = randn((b, s, 2, 2 * hdim + 8), torch.bfloat16, gen)                  # padded rows, GQA 2:1
    k, v = kv[..., :hdim], kv[..., hdim + 8:]
    for causal in (False, True):
        check(q, k, v, causal, scale=0.3)


def test_return_forms_and_window_alias():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (randn((1, 64, 2, 128), torch.bfloat16, gen) for _ in range(3))
    out = flash3.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    causal = flash3.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash3.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(flash3.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True), out)


def test_requires_grad_forward_works_backward_raises():
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (randn((1, 64, 2, 64), torch.float16, gen).requires_grad_() for _ in range(3))
    out, lse = flash3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    check(q.detach(), k.detach(), v.detach(), True, out=out.detach(), lse=lse)
    with pytest.raises(NotImplementedError, match="backward is not implemented"):
        out.float().sum().backward()


@pytest.mark.parametrize("kwargs, name", [
    (dict(window_size=(128, 0)), "window_size"),
    (dict(softcap=30.0), "softcap"),
    (dict(attention_chunk=256), "attention_chunk"),
    (dict(q_descale=1.0), "q_descale"),
])
def test_unsupported_options(kwargs, name):
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=name):
        flash3.flash_attn_func(q, q, q, **kwargs)
    with pytest.raises(TypeError, match="no_such_option"):
        flash3.flash_attn_func(q, q, q, no_such_option=1)


def _bad(q_shape=(1, 16, 4, 128), kv_shape=None, dtype=torch.bfloat16, kdtype=None, device="cuda"):
    kv_shape = kv_shape or q_shape
    q = torch.randn(q_shape, device=device).to(dtype)
    k = torch.randn(kv_shape, device=device).to(kdtype or dtype)
    v = torch.randn(kv_shape, device=device).to(dtype)
    return q, k, v


@pytest.mark.parametrize("args, kwargs, pattern", [
    (dict(q_shape=(1, 16, 4, 96)), {}, r"head.?dim|\b96\b"),
    (dict(kdtype=torch.float16), {}, r"\bk\b"),
    (dict(dtype=torch.float32), {}, r"\bq\b|float32|dtype"),
    (dict(device="cpu"), {}, r"\bq\b"),
    (dict(kv_shape=(2, 16, 4, 128)), {}, r"\bk\b|batch"),
    (dict(q_shape=(1, 16, 3, 128), kv_shape=(1, 16, 2, 128)), {}, r"head"),
    (dict(), dict(softmax_scale=-1.0), r"softmax_scale"),
], ids=["hdim96", "k_dtype", "fp32", "cpu", "batch", "nheads_gqa", "scale"])
def test_bad_input_raises_value_error_naming_argument(args, kwargs, pattern):
    q, k, v = _bad(**args)
    with pytest.raises(ValueError) as e:
        flash3.flash_attn_func(q, k, v, **kwargs)
    assert re.search(pattern, str(e.value), re.I), str(e.value)
