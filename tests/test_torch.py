"""Tests of the PyTorch binding (python/flash3) against an fp64 reference.

Tolerance (FlashAttention-3's rule): max |flash3 - fp64| <= 2 * max |plain - fp64| + atol, where
`plain` is the same attention done by torch in the input dtype (scores, softmax, P, PV in dtype)
and fp64 the same in float64 on the GPU; atol is 1e-5 for the forward output, 1e-4 for dq, dk, dv
(whose fp64 and plain values come from torch autograd through that math).
GPU tests need a Hopper GPU and libflash3.so and skip elsewhere; the few tests marked CPU run
anywhere torch is installed. Run on the GPU machine: python3 -m pytest -q tests/test_torch.py
"""
import inspect
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
gpu = pytest.mark.skipif(not (_hopper and _ok), reason=f"needs a Hopper GPU and libflash3.so: {_why}")

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
    """(out (b, sq, h, d), lse (b, h, sq)). upcast: in fp64; else plainly in the input dtype.
    Differentiable (torch autograd gives the reference gradients), NaN-free also where a causal
    row sees no key: that row's scores are made finite and its probabilities zeroed."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    rows = None
    if causal:
        vis = visible(q.shape[1], k.shape[1], q.device)
        rows = vis.any(dim=1)[:, None]  # query rows that see at least one key
        s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.double(), dim=-1)
    if rows is not None:
        s = s.masked_fill(~rows, 0.0)
    p = torch.softmax(s, dim=-1)
    if rows is not None:
        p = p * rows  # rows with no visible key: 0
    return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v), lse


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


@gpu
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


@gpu
@pytest.mark.parametrize("hdim", HDIMS)
def test_strided_inputs_and_scale(hdim):
    gen = torch.Generator(device="cuda").manual_seed(hdim)
    b, s, h = 2, 300, 4
    q = randn((b, h, s, hdim), torch.bfloat16, gen).transpose(1, 2)           # (b, s, h, d) view of bhsd
    kv = randn((b, s, 2, 2 * hdim + 8), torch.bfloat16, gen)                  # padded rows, GQA 2:1
    k, v = kv[..., :hdim], kv[..., hdim + 8:]
    for causal in (False, True):
        check(q, k, v, causal, scale=0.3)


@gpu
def test_return_forms_and_window_alias():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (randn((1, 64, 2, 128), torch.bfloat16, gen) for _ in range(3))
    out = flash3.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    causal = flash3.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash3.flash_attn_func(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(flash3.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True), out)
    assert torch.equal(flash3.flash_attn_func(q, k, v, deterministic=True), out)  # no grad: forward only


@gpu
def test_requires_grad_forward_and_backward():
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (randn((1, 64, 2, 64), torch.float16, gen).requires_grad_() for _ in range(3))
    out, lse = flash3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad
    check(q.detach(), k.detach(), v.detach(), True, out=out.detach(), lse=lse)
    out.float().sum().backward()  # the incoming gradient is a stride-0 expand of ones
    got = (q.grad, k.grad, v.grad)
    # only q requires grad: k and v get none
    q2, k2, v2 = q.detach().clone().requires_grad_(), k.detach(), v.detach()
    flash3.flash_attn_func(q2, k2, v2, causal=True).float().sum().backward()
    assert k2.grad is None and v2.grad is None
    check_grads(q, k, v, torch.ones_like(out), True, got, (q2.grad, k.grad, v.grad))


@gpu
@pytest.mark.parametrize("kwargs, name", [
    (dict(window_size=(128, 0)), "window_size"),
    (dict(softcap=30.0), "softcap"),
    (dict(attention_chunk=256), "attention_chunk"),
])
def test_unsupported_options(kwargs, name):
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=name):
        flash3.flash_attn_func(q, q, q, **kwargs)
    # FP8 descales with 16-bit inputs: a ValueError naming the argument
    with pytest.raises(ValueError, match="q_descale"):
        flash3.flash_attn_func(q, q, q, q_descale=1.0)
    with pytest.raises(TypeError, match="no_such_option"):
        flash3.flash_attn_func(q, q, q, no_such_option=1)


def _bad(q_shape=(1, 16, 4, 128), kv_shape=None, dtype=torch.bfloat16, kdtype=None, device="cuda"):
    kv_shape = kv_shape or q_shape
    q = torch.randn(q_shape, device=device).to(dtype)
    k = torch.randn(kv_shape, device=device).to(kdtype or dtype)
    v = torch.randn(kv_shape, device=device).to(dtype)
    return q, k, v


@gpu
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


@gpu
def test_huge_scale_is_rejected():
    """softmax_scale = 1e30 (finite) gave NaN in about half of the outputs: float32 exponents are
    exact only up to softmax_scale 2^11 (validate.cpp), so both passes say so by name instead."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (randn((1, 64, 2, 64), torch.bfloat16, gen).requires_grad_() for _ in range(3))
    out = flash3.flash_attn_func(q, k, v, softmax_scale=2048.0)
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    with pytest.raises(ValueError, match=r"softmax_scale is 1e\+30.*at most 2048"):
        flash3.flash_attn_func(q, k, v, softmax_scale=1e30)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shapes", [((0, 64, 4, 128), (0, 80, 2, 128)), ((2, 0, 4, 128), (2, 80, 2, 128))],
                         ids=["batch0", "seqlen_q0"])
def test_empty_forward_and_backward_are_no_ops(shapes, causal):
    """Empty tensors pass through forward and backward: out.sum().backward() hands over an empty
    dout whose strides are all 0 (it raised "dout.stride[3] is 0"). With keys but no queries the
    key gradients are 0."""
    q_shape, kv_shape = shapes
    q = torch.randn(q_shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = flash3.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (q_shape[0], q_shape[2], q_shape[1])
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
    assert (k.grad == 0).all() and (v.grad == 0).all()
    # the same through backward_into with an expanded (stride-0) empty dout
    dout = torch.ones((), device="cuda", dtype=torch.bfloat16).expand(q_shape)
    flash3.backward_into(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, torch.empty_like(q),
                         torch.empty_like(k), torch.empty_like(v), causal=causal)


# ---- backward --------------------------------------------------------------------------------

def check_grads(q, k, v, dout, causal, *gots, scale=None):
    """Compares each got = (dq, dk, dv) with torch autograd through `attention` in fp64 under the
    tolerance rule, the baseline being autograd through the same math in the input dtype."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention(*wide, s, causal, upcast=True)[0], wide, dout.double())
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    plain = torch.autograd.grad(attention(*low, s, causal, upcast=False)[0], low, dout.to(q.dtype))
    for got in gots:
        for name, g, r, p, t in zip(("dq", "dk", "dv"), got, ref, plain, (q, k, v)):
            assert g is not None, f"{name} is None"
            assert g.shape == t.shape and g.dtype == t.dtype, f"{name}: {tuple(g.shape)} {g.dtype}"
            assert torch.isfinite(g).all(), f"non-finite values in {name}"
            err = (g.double() - r).abs().max().item()
            plain_err = (p.double() - r).abs().max().item()
            assert err <= 2 * plain_err + 1e-4, \
                f"{name}: max abs err {err:.3e} > 2 * plain {plain_err:.3e} + 1e-4"


def leaves(shape_q, shape_kv, dtype, gen):
    """q, k, v leaf tensors that require grad, and a dout like q."""
    q = randn(shape_q, dtype, gen).requires_grad_()
    k, v = (randn(shape_kv, dtype, gen).requires_grad_() for _ in range(2))
    return q, k, v, randn(shape_q, dtype, gen)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): ragged lengths, MHA / GQA / MQA
BWD_SHAPES = [
    (2, 113, 129, 4, 4),    # MHA, sq < sk, neither a tile multiple
    (1, 113, 129, 6, 2),    # GQA 3:1
    (1, 1000, 1000, 4, 1),  # MQA: dk, dv sum over 4 query heads
    (2, 17, 300, 4, 2),     # short q, long k, GQA 2:1
    (1, 300, 17, 4, 4),     # sq > sk: causal rows that see no key get dq = 0
    (2, 128, 128, 2, 1),    # tile-aligned MQA
]


def _kind(h, hk):
    return "mha" if h == hk else ("mqa" if hk == 1 else "gqa")


@gpu
@pytest.mark.parametrize("shape", BWD_SHAPES,
                         ids=lambda s: "b{}_sq{}_sk{}_{}{}x{}".format(*s[:3], _kind(*s[3:]), *s[3:]))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_backward_matches_fp64(dtype, hdim, causal, shape):
    b, sq, sk, h, hk = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((hdim, causal, 7) + shape) % 2**31)
    q, k, v, dout = leaves((b, sq, h, hdim), (b, sk, hk, hdim), dtype, gen)
    out, lse = flash3.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    loss = (out.float() * dout.float()).sum()  # d loss / d out = dout
    loss.backward()
    gots = [(q.grad, k.grad, v.grad)]
    # every element written: backward_into NaN-poisoned buffers, deterministic and not
    for det in (False, True):
        bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        flash3.backward_into(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, *bufs,
                             causal=causal, deterministic=det)
        gots.append(bufs)
    torch.cuda.synchronize()
    check_grads(q, k, v, dout, causal, *gots)
    if causal and sq > sk:  # the library's contract for rows that see no key
        rows = visible(sq, sk, q.device).any(dim=1)
        assert all((got[0][:, ~rows] == 0).all() for got in gots)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_deterministic_backward_is_bitwise_reproducible(dtype, hdim, causal):
    # many key blocks add into each dq row, 4 query heads into each dk, dv row
    b, sq, sk, h, hk = 2, 1000, 1100, 8, 2
    gen = torch.Generator(device="cuda").manual_seed(hdim + causal)
    q, k, v, dout = leaves((b, sq, h, hdim), (b, sk, hk, hdim), dtype, gen)
    runs = []
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        flash3.flash_attn_func(q, k, v, causal=causal, deterministic=True).backward(dout)
        runs.append((q.grad, k.grad, v.grad))
    for run in runs[1:]:
        for name, a, b_ in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a, b_), f"{name} differs between deterministic runs"
    check_grads(q, k, v, dout, causal, runs[0])


@gpu
@pytest.mark.parametrize("layout", ["last_dim_strided", "bhsd_view", "padded_rows", "unaligned_rows",
                                    "expanded"])
def test_backward_noncontiguous_dout(layout):
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, sq, sk, h, hk, d = 2, 200, 300, 4, 2, 128
    q, k, v, _ = leaves((b, sq, h, d), (b, sk, hk, d), torch.bfloat16, gen)
    make = {
        "last_dim_strided": lambda: randn((b, sq, h, 2 * d), torch.bfloat16, gen)[..., ::2],  # copied
        "bhsd_view": lambda: randn((b, h, sq, d), torch.bfloat16, gen).transpose(1, 2),       # read as is
        "padded_rows": lambda: randn((b, sq, h, d + 8), torch.bfloat16, gen)[..., :d],        # read as is
        "unaligned_rows": lambda: randn((b, sq, h, d + 4), torch.bfloat16, gen)[..., :d],     # copied
        "expanded": lambda: randn((1, 1, h, d), torch.bfloat16, gen).expand(b, sq, h, d),     # copied
    }
    dout = make[layout]()
    assert not dout.is_contiguous()
    before = dout.clone()
    for causal in (False, True):
        q.grad = k.grad = v.grad = None
        flash3.flash_attn_func(q, k, v, causal=causal).backward(dout)
        check_grads(q, k, v, dout.contiguous(), causal, (q.grad, k.grad, v.grad))
    assert torch.equal(dout, before)


@gpu
def test_backward_with_scale_strided_inputs_and_side_stream():
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, s, h, d = 2, 300, 4, 64
    q = randn((b, h, s, d), torch.float16, gen).transpose(1, 2).requires_grad_()   # bhsd storage
    kv = randn((b, s, 2, 2 * d + 8), torch.float16, gen)                           # padded rows, GQA
    k = kv[..., :d].detach().requires_grad_()
    v = kv[..., d + 8:].detach().requires_grad_()
    dout = randn((b, s, h, d), torch.float16, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # forward and backward on a side stream
        out = flash3.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
        out.backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    check_grads(q, k, v, dout, True, (q.grad, k.grad, v.grad), scale=0.3)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_graph_capture_and_replay(causal):
    """Forward and backward captured into a CUDA graph (as inference servers and torch.compile's
    cudagraphs do) and replayed: the same outputs and gradients as eager calls, bitwise. The
    non-causal shape uses the tail split (its tail kernel launched with programmatic dependent
    launch inside the graph), the causal one the dynamic tile scheduler; both find their
    per-stream memory allocated by the eager warm-up on the capture stream."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    b, sq, sk, h, hk, d = 1, 2112, 3000, 8, 2, 128
    if causal:
        sq = sk = 1536
    q = randn((b, sq, h, d), torch.bfloat16, gen).requires_grad_()
    k = randn((b, sk, hk, d), torch.bfloat16, gen).requires_grad_()
    v = randn((b, sk, hk, d), torch.bfloat16, gen).requires_grad_()
    dout = randn((b, sq, h, d), torch.bfloat16, gen)

    def step():  # deterministic: the default backward's dQ sums run in arrival order
        out = flash3.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return (out,) + tuple(grads)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = [t.clone() for t in step()]  # also allocates the stream's scratch and counters
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    for _ in range(2):
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(("out", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(got, want), f"{name} from the replayed graph differs from the eager call"


def _bwd_args(seed=3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = randn((1, 64, 4, 128), torch.bfloat16, gen)
    k, v = (randn((1, 80, 2, 128), torch.bfloat16, gen) for _ in range(2))
    out, lse = flash3.flash_attn_func(q, k, v, return_attn_probs=True)
    return dict(dout=randn(tuple(out.shape), torch.bfloat16, gen), q=q, k=k, v=v, out=out, lse=lse,
                dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))


@gpu
def test_backward_into_workspace_comes_from_torch():
    a = _bwd_args()
    flash3.backward_into(**a)  # warm the caching allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    dq, dk, dv = flash3.backward_into(**a)
    torch.cuda.synchronize()
    assert dq is a["dq"] and dk is a["dk"] and dv is a["dv"]
    assert torch.cuda.memory_allocated() == before  # the workspace went back to the allocator
    check_grads(a["q"], a["k"], a["v"], a["dout"], False, (dq, dk, dv))


@gpu
@pytest.mark.parametrize("name, change", [
    ("dq", lambda a: torch.empty(1, 65, 4, 128, device="cuda", dtype=torch.bfloat16)),
    ("dk", lambda a: a["dk"].half()),
    ("dv", lambda a: a["dv"][:, :, :1]),
    ("dq", lambda a: None),
    ("lse", lambda a: a["lse"].to(torch.bfloat16)),
    ("lse", lambda a: a["lse"][:, :2]),
    ("lse", lambda a: None),
    ("dout", lambda a: a["dout"].cpu()),
    ("dout", lambda a: a["dout"][:, :32]),
    ("dout", lambda a: torch.randn(1, 64, 4, 256, device="cuda", dtype=torch.bfloat16)[..., ::2]),
    ("out", lambda a: a["out"].half()),
    ("softmax_scale", lambda a: -1.0),
], ids=["dq_shape", "dk_dtype", "dv_heads", "dq_none", "lse_dtype", "lse_shape", "lse_none", "dout_cpu",
        "dout_shape", "dout_last_stride", "out_dtype", "scale"])
def test_backward_into_bad_input_raises_value_error_naming_argument(name, change):
    a = _bwd_args()
    a[name] = change(a)
    with pytest.raises(ValueError) as e:
        flash3.backward_into(**a)
    assert re.search(rf"\b{name}\b", str(e.value)), str(e.value)


# ---- without a GPU ---------------------------------------------------------------------------

def test_cpu_flash_attn_func_signature_follows_fa3():
    params = inspect.signature(flash3.flash_attn_func).parameters
    assert params["deterministic"].default is False
    assert params["return_attn_probs"].default is False
    assert "deterministic" not in flash3._IGNORED
    bparams = list(inspect.signature(flash3.backward_into).parameters)
    assert bparams[:9] == ["dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"]


def test_cpu_backward_into_rejects_before_any_launch():
    t = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash3.backward_into(t, t, t, t, t, lse, t, t, t, softmax_scale=float("inf"))
    with pytest.raises(ValueError, match=r"\bq\b.*CUDA"):
        flash3.backward_into(t, t, t, t, t, lse, t, t, t)


def test_cpu_kernel_layout_rule_for_incoming_gradients():
    x = torch.zeros(2, 32, 4, 128, dtype=torch.bfloat16)
    assert flash3._kernel_layout(x)
    assert flash3._kernel_layout(torch.zeros(2, 4, 32, 128, dtype=torch.bfloat16).transpose(1, 2))
    assert flash3._kernel_layout(torch.zeros(2, 32, 4, 136, dtype=torch.bfloat16)[..., :128])
    assert not flash3._kernel_layout(torch.zeros(2, 32, 4, 132, dtype=torch.bfloat16)[..., :128])
    assert not flash3._kernel_layout(torch.zeros(2, 32, 4, 256, dtype=torch.bfloat16)[..., ::2])
    assert not flash3._kernel_layout(torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16).expand(2, 32, 4, 128))
    one = torch.zeros(32 * 4 * 128, dtype=torch.bfloat16).as_strided((1, 32, 4, 128), (3, 512, 128, 1))
    assert flash3._kernel_layout(one)  # the stride of a dim of size 1 is never used


def test_cpu_autograd_wiring(monkeypatch):
    """loss.backward() reaches the library's backward with the forward's saved tensors and options
    and a kernel-readable dout; the library calls are stood in for by the math on the CPU
    (tests/stand_in.py)."""
    import stand_in
    calls = stand_in.install(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 12, 2, 8, generator=gen).requires_grad_() for _ in range(2))
    out, lse = flash3.flash_attn_func(q, k, v, softmax_scale=0.5, causal=True, deterministic=True,
                                      return_attn_probs=True)
    assert not lse.requires_grad
    out.sum().backward()  # a stride-0 dout: handed over as a contiguous copy
    assert [name for name, _ in calls] == ["fwd", "bwd"]
    c = calls[1][1]
    assert (c["softmax_scale"], c["causal"], c["deterministic"]) == (0.5, True, True)
    assert c["dout"].is_contiguous() and torch.equal(c["dout"], torch.ones_like(out))
    saved = calls[0][1]  # the forward's own out and lse are what the backward reads
    assert c["out"].data_ptr() == saved["out"].data_ptr() and c["lse"].data_ptr() == saved["lse"].data_ptr()
    assert c["lse"].shape == (2, 4, 9)
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention(*xs, 0.5, True, upcast=False)[0].sum(), xs)
    for got, r in zip((q.grad, k.grad, v.grad), ref):
        assert torch.allclose(got, r, atol=1e-5)


def test_cpu_lse_gradient_not_materialized(monkeypatch):
    """The backward gets None for the non-differentiable lse, not a zero-filled float32 tensor
    (one allocation and one fill kernel per call), and the gradients are unchanged."""
    import stand_in
    calls, seen = stand_in.install(monkeypatch), []
    func = flash3.flash_attn_interface._FlashAttnFunc
    original = func.backward

    def spy(ctx, dout, dlse):
        seen.append(dlse)
        return original(ctx, dout, dlse)

    monkeypatch.setattr(func, "backward", staticmethod(spy))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 7, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 7, 2, 8, generator=gen)
    out, lse = flash3.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, return_attn_probs=True)
    out.backward(dout)
    assert seen == [None] and [name for name, _ in calls] == ["fwd", "bwd"]
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention(*xs, 0.25, True, upcast=False)[0], xs, dout)
    for got, r in zip((q.grad, k.grad, v.grad), ref):
        assert torch.allclose(got, r, atol=1e-5)
