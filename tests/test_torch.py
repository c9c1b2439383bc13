"""Tests of the PyTorch binding (python/flash3) against an fp64 reference.

Tolerance (FlashAttention-3's rule): max |flash3 - fp64| <= 2 * max |plain - fp64| + atol, where
`plain` is the same attention done by torch in the input dtype (scores, softcap, softmax, P, PV in
dtype; its gradients by torch autograd through that math) and fp64 the FP64 stand-in of
tests/stand_in.py (out, lse and the gradients in float64 on the GPU); atol is 1e-5 for the
forward output, 1e-4 for dq, dk, dv. The masks: causal and FlashAttention-3's sliding window.
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
import c_probe  # noqa: E402
import stand_in  # noqa: E402

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


def visible(sq, sk, device, causal=True, window=(-1, -1)):
    """The bottom-right aligned mask: key j is visible to query i iff j <= i + sk - sq (causal)
    and i + sk - sq - left <= j <= i + sk - sq + right (FlashAttention-3's window (left, right),
    -1: no bound on that side; causal makes right 0)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    left, right = window
    if causal:
        right = 0
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        vis &= j <= i + sk - sq + right
    if left >= 0:
        vis &= j >= i + sk - sq - left
    return vis


def attention(q, k, v, scale, causal, upcast, window=(-1, -1), softcap=0.0):
    """(out (b, sq, h, d), lse (b, h, sq)). upcast: in fp64; else plainly in the input dtype.
    window: FlashAttention-3's (left, right) (visible); softcap > 0: scores s become softcap *
    tanh(s / softcap) (in the same dtype). Differentiable (torch autograd gives the plain
    gradients), NaN-free also where a row sees no key: that row's scores are made finite and
    its probabilities zeroed."""
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rows = None
    if causal or tuple(window) != (-1, -1):
        vis = visible(q.shape[1], k.shape[1], q.device, causal, window)
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


def check(q, k, v, causal, scale=None, out=None, lse=None, window=(-1, -1), softcap=0.0):
    """Compares (out, lse) from flash3 with the fp64 reference (the stand-in) under the
    tolerance rule; window and softcap as flash_attn_func's. v may have a head dim of its own
    (out then has it: MLA, tests/test_kvcache.py)."""
    if out is None:
        out, lse = flash3.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                          softcap=softcap, return_attn_probs=True)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = q.detach(), k.detach(), v.detach()
    ref, ref_lse = stand_in.attention(q, k, v, s, causal, window, softcap)
    plain, _ = attention(q, k, v, s, causal, upcast=False, window=window, softcap=softcap)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in out"
    err = (out.double() - ref).abs().max().item()
    plain_err = (plain.double() - ref).abs().max().item()
    assert err <= 2 * plain_err + 1e-5, f"max abs err {err:.3e} > 2 * plain {plain_err:.3e} + 1e-5"
    b, sq, h, _ = q.shape
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    rows = visible(sq, k.shape[1], q.device, causal, window).any(dim=1)
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
    (dict(attention_chunk=256), "attention_chunk"),
    (dict(qv=torch.zeros(1)), "qv"),
], ids=["attention_chunk", "qv"])
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

def check_grads(q, k, v, dout, causal, *gots, scale=None, window=(-1, -1), softcap=0.0):
    """Compares each got = (dq, dk, dv) with the fp64 gradients of the stand-in under the
    tolerance rule, the baseline being torch autograd through `attention` in the input dtype;
    window and softcap as flash_attn_func's."""
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref = stand_in.attention_grads(dout.detach(), q.detach(), k.detach(), v.detach(), s, causal, window, softcap)
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    plain = torch.autograd.grad(attention(*low, s, causal, upcast=False, window=window, softcap=softcap)[0], low,
                                dout.to(q.dtype))
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


def capture(step):
    """(graph, eager, captured): step() run once eagerly on a side stream (its outputs cloned into
    eager; this also allocates the stream's scratch and counters), then captured into a CUDA
    graph on that stream (its outputs, rewritten by each graph.replay(), in captured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = [t.clone() for t in step()]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    return graph, eager, captured


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

    graph, eager, captured = capture(step)
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


# ---- sliding window and softcap ------------------------------------------------------------------

# (left, right) against the tiles (64 to 192 rows or keys): bands of one or a few keys, a band
# within a tile and across many, one side unbounded, and (1000, 2000) wider than the sequences
WINDOWS = [(0, 0), (1, 0), (5, 3), (100, 0), (-1, 37), (200, 300), (0, -1), (1000, 2000)]
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): no tile multiples; sq < sk, sq > sk (rows that
# see no key under a window or causal), sq == sk; GQA and MQA
WINDOW_SHAPES = [(1, 300, 517, 4, 2), (1, 517, 300, 6, 2), (2, 177, 177, 2, 1)]


def _window_cases():
    """Every window with and without causal at every head dim (48 cases); the dtype and the shape
    rotate so that each window meets both dtypes and each head dim every shape."""
    cases = []
    for w, window in enumerate(WINDOWS):
        for causal in (False, True):
            for h, hdim in enumerate(HDIMS):
                dtype = DTYPES[(w + causal) % 2]
                shape = WINDOW_SHAPES[(w + causal + h) % len(WINDOW_SHAPES)]
                cases.append(pytest.param(window, causal, hdim, dtype, shape, id="w{}_{}-{}-h{}-{}-sq{}_sk{}_{}".format(
                    *window, "causal" if causal else "full", hdim, "bf16" if dtype is torch.bfloat16 else "fp16",
                    shape[1], shape[2], _kind(*shape[3:]))))
    return cases


def _run_window(q, k, v, dout, causal, window, softcap):
    """flash_attn_func forward and backward (autograd), and the same through forward_into and
    backward_into (default and deterministic) into NaN-poisoned buffers, with the window and
    softcap flash_attn_func hands the library. Returns (out, lse, [(dq, dk, dv), ...])."""
    out, lse = flash3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                      return_attn_probs=True)
    (out.float() * dout.float()).sum().backward()
    gots = [(q.grad, k.grad, v.grad)]
    c, left, right = flash3.flash_attn_interface._window(window, causal)
    opts = dict(causal=c, window_left=left, window_right=right, softcap=softcap)
    qd, kd, vd, od = q.detach(), k.detach(), v.detach(), out.detach()
    out2 = torch.full_like(qd, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    flash3.forward_into(qd, kd, vd, out2, lse2, **opts)
    for det in (False, True):
        bufs = [torch.full_like(t, float("nan")) for t in (qd, kd, vd)]
        flash3.backward_into(dout, qd, kd, vd, od, lse, *bufs, deterministic=det, **opts)
        gots.append(bufs)
    torch.cuda.synchronize()
    assert torch.equal(out2, od) and torch.equal(lse2, lse), "forward_into into poisoned buffers differs"
    return od, lse, gots


@gpu
@pytest.mark.parametrize("window, causal, hdim, dtype, shape", _window_cases())
def test_window_matches_fp64(window, causal, hdim, dtype, shape):
    b, sq, sk, h, hk = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((hdim, causal, 11) + window + shape) % 2**31)
    q, k, v, dout = leaves((b, sq, h, hdim), (b, sk, hk, hdim), dtype, gen)
    out, lse, gots = _run_window(q, k, v, dout, causal, window, 0.0)
    check(q, k, v, causal, out=out, lse=lse, window=window)
    check_grads(q, k, v, dout, causal, *gots, window=window)
    rows = visible(sq, sk, q.device, causal, window).any(dim=1)
    if not rows.all():  # the library's contract for rows that see no key: dq 0 (out 0, lse +inf: check)
        assert all((got[0][:, ~rows] == 0).all() for got in gots)
    if window == (1000, 2000):  # wider than both sequences: no window at all, the same kernels
        with torch.no_grad():
            same = flash3.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        assert torch.equal(same[0], out) and torch.equal(same[1], lse)


@gpu
@pytest.mark.parametrize("softcap", [1.0, 5.0, 50.0])
@pytest.mark.parametrize("hdim", HDIMS)
def test_softcap_matches_fp64(hdim, softcap):
    """softcap alone, with causal and with a window, forward and backward; GQA, both dtypes and
    the shapes of WINDOW_SHAPES in turn."""
    i = HDIMS.index(hdim) + [1.0, 5.0, 50.0].index(softcap)
    dtype, shape = DTYPES[i % 2], WINDOW_SHAPES[i % len(WINDOW_SHAPES)]
    b, sq, sk, h, hk = shape
    gen = torch.Generator(device="cuda").manual_seed(hash((hdim, softcap, 13) + shape) % 2**31)
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (64, 17)), (True, (150, -1))):
        q, k, v, dout = leaves((b, sq, h, hdim), (b, sk, hk, hdim), dtype, gen)
        out, lse, gots = _run_window(q, k, v, dout, causal, window, softcap)
        check(q, k, v, causal, out=out, lse=lse, window=window, softcap=softcap)
        check_grads(q, k, v, dout, causal, *gots, window=window, softcap=softcap)


@gpu
@pytest.mark.parametrize("hdim", HDIMS)
def test_deterministic_backward_with_window_is_bitwise_reproducible(hdim):
    causal, window, softcap = [(True, (300, -1), 0.0), (False, (150, 200), 5.0), (False, (0, -1), 0.0)][
        HDIMS.index(hdim)]
    b, sq, sk, h, hk = 2, 1000, 1100, 8, 2
    gen = torch.Generator(device="cuda").manual_seed(hdim + 17)
    q, k, v, dout = leaves((b, sq, h, hdim), (b, sk, hk, hdim), torch.bfloat16, gen)
    runs = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        flash3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                               deterministic=True).backward(dout)
        runs.append((q.grad, k.grad, v.grad))
    for name, a, b_ in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b_), f"{name} differs between deterministic runs"
    check_grads(q, k, v, dout, causal, runs[0], window=window, softcap=softcap)


@gpu
def test_window_and_softcap_errors_name_the_argument():
    """Out-of-range values reach the user as the library's ValueError naming the argument, from
    the forward and the backward; softcap with float8 inputs too."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    q, k, v = (randn((1, 64, 2, 64), torch.bfloat16, gen) for _ in range(3))
    out, lse = flash3.flash_attn_func(q, k, v, return_attn_probs=True)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    for kwargs, name in [(dict(window_left=-2), "window_left"), (dict(window_right=-5), "window_right"),
                         (dict(softcap=-1.0), "softcap"), (dict(softcap=float("inf")), "softcap"),
                         (dict(softcap=float("nan")), "softcap"), (dict(softcap=4096.0), "softcap")]:
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            flash3.forward_into(q, k, v, torch.empty_like(q), **kwargs)
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            flash3.backward_into(out, q, k, v, out, lse, *bufs, **kwargs)
    with pytest.raises(ValueError, match=r"\bsoftcap\b"):
        flash3.flash_attn_func(q, k, v, softcap=-3.0)
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"\bsoftcap\b"):
        flash3.flash_attn_func(q.to(e4m3), k.to(e4m3), v.to(e4m3), softcap=5.0)
    assert torch.isfinite(flash3.flash_attn_func(q, k, v, softcap=2048.0)).all()


# ---- without a GPU ---------------------------------------------------------------------------

def test_cpu_flash_attn_func_signature_follows_fa3():
    params = inspect.signature(flash3.flash_attn_func).parameters
    assert params["deterministic"].default is False
    assert params["return_attn_probs"].default is False
    assert "deterministic" not in flash3._IGNORED
    bparams = list(inspect.signature(flash3.backward_into).parameters)
    assert bparams[:9] == ["dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"]


C_PROBE = r"""
#include <stdint.h>
#include "flash3/flash3_c.h"
static double seen[16];
const double* probe_seen(void) { return seen; }
uint64_t probe_layout(int i) {
  const uint64_t v[] = {sizeof(flash3_fwd_args), FLASH3_FWD_ARGS_SIZE_V3, FLASH3_FWD_ARGS_SIZE_V2,
                        offsetof(flash3_fwd_args, window), offsetof(flash3_fwd_args, window_left),
                        offsetof(flash3_fwd_args, window_right), offsetof(flash3_fwd_args, softcap),
                        sizeof(flash3_bwd_args), FLASH3_BWD_ARGS_SIZE_V2, FLASH3_BWD_ARGS_SIZE_V1,
                        offsetof(flash3_bwd_args, window), offsetof(flash3_bwd_args, window_left),
                        offsetof(flash3_bwd_args, window_right), offsetof(flash3_bwd_args, softcap)};
  return v[i];
}
int probe_fwd(const flash3_fwd_args* a, char* err, int n) {
  const double v[] = {a->struct_size, a->causal, a->softmax_scale, a->window, a->window_left, a->window_right,
                      a->softcap, (double)a->q.shape[1], (double)a->k.shape[1], (double)(uintptr_t)a->stream,
                      a->lse.data != 0, a->v_scale.data != 0};
  for (int i = 0; i < 12; ++i) seen[i] = v[i];
  (void)err; (void)n;
  return 0;
}
static void bwd_seen(const flash3_bwd_args* a) {
  const double v[] = {a->struct_size, a->causal, a->deterministic, a->softmax_scale, a->window, a->window_left,
                      a->window_right, a->softcap, (double)a->dv.shape[1], (double)(uintptr_t)a->stream,
                      (double)a->workspace_bytes};
  for (int i = 0; i < 11; ++i) seen[i] = v[i];
}
int probe_bwd(const flash3_bwd_args* a, char* err, int n) { bwd_seen(a); (void)err; (void)n; return 0; }
int probe_bwd_workspace_size(const flash3_bwd_args* a, uint64_t* bytes, char* err, int n) {
  bwd_seen(a); *bytes = 0; (void)err; (void)n; return 0;
}
"""


def test_cpu_packed_args_match_c_header(tmp_path, monkeypatch):
    """The structs forward_into and backward_into pack have the layout of include/flash3/flash3_c.h
    as a C compiler lays it out (flash3_fwd_args up to v3, flash3_bwd_args up to v2: the fields
    before the variable-length ones, tests/test_varlen.py): the sizes, the offsets of the window
    and softcap fields, and the values a C function reads from the packed bytes (the library
    stood in for by that function; CPU tensors let through as CUDA ones)."""
    import ctypes
    from flash3 import _kernels, _lib
    # without a compiler: the ctypes mirror at least (sizes, and packed bytes read back)
    assert (_lib.FWD_ARGS_SIZE_V3, _lib.BWD_ARGS_SIZE_V2) == (_kernels._FWD.size, _kernels._BWD.size) == (680, 776)
    packed = _lib.FwdArgs.from_buffer_copy(_kernels._FWD.pack(680, 1, 0.5, 0, *(0,) * 55, 7, *(0,) * 33,
                                                              *_kernels.mask_fields(5, -1, 2.5)) + bytes(336))
    assert (packed.stream, packed.window, packed.window_left, packed.window_right, packed.softcap) == (7, 1, 5, -1, 2.5)
    packed = _lib.BwdArgs.from_buffer_copy(_kernels._BWD.pack(776, 0, 1, 0.5, *(0,) * 99, 0, 0, 9,
                                                              *_kernels.mask_fields(-1, 3, 0.0)) + bytes(336))
    assert (packed.stream, packed.window, packed.window_left, packed.window_right, packed.softcap) == (9, 1, -1, 3, 0.0)
    probe = c_probe.build(tmp_path, C_PROBE)
    probe.probe_layout.restype = ctypes.c_uint64
    probe.probe_seen.restype = ctypes.POINTER(ctypes.c_double)
    layout = [probe.probe_layout(i) for i in range(14)]
    fwd_size, fwd_v3, fwd_v2, *fwd_offsets = layout[:7]
    bwd_size, bwd_v2, bwd_v1, *bwd_offsets = layout[7:]
    assert fwd_v3 == _lib.FWD_ARGS_SIZE_V3 == _kernels._FWD.size == fwd_v2 + 16 and fwd_size == _lib.FWD_ARGS_SIZE
    assert bwd_v2 == _lib.BWD_ARGS_SIZE_V2 == _kernels._BWD.size == bwd_v1 + 16 and bwd_size == _lib.BWD_ARGS_SIZE
    assert fwd_offsets == [getattr(_lib.FwdArgs, f).offset for f in ("window", "window_left", "window_right", "softcap")]
    assert bwd_offsets == [getattr(_lib.BwdArgs, f).offset for f in ("window", "window_left", "window_right", "softcap")]

    ptr = ctypes.c_void_p
    probe.probe_fwd.argtypes = probe.probe_bwd.argtypes = [ptr, ctypes.c_char_p, ctypes.c_int]
    probe.probe_bwd_workspace_size.argtypes = [ptr, ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_int]
    for name in ("flash3_fwd", "flash3_bwd", "flash3_bwd_workspace_size"):
        setattr(probe, name, getattr(probe, name.replace("flash3", "probe")))
    monkeypatch.setattr(_lib, "lib", lambda: probe)
    monkeypatch.setattr(_lib, "has_bwd", lambda: True)
    monkeypatch.setattr(_kernels, "_on_device", lambda index: __import__("contextlib").nullcontext())
    monkeypatch.setattr(_kernels, "_stream", lambda index: 0x5000)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(_kernels, "_BWD_WORKSPACE_BYTES", {})

    def seen(n):
        return [probe.probe_seen()[i] for i in range(n)]

    q, k = torch.zeros(1, 9, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 12, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 9)
    for opts, mask in [(dict(), [0, -1, -1, 0.0]),
                       (dict(window_left=5, window_right=-1, softcap=2.5), [1, 5, -1, 2.5]),
                       (dict(window_left=-1, window_right=0), [1, -1, 0, 0.0]),
                       (dict(window_left=2**40, window_right=3, softcap=30), [1, 2**31 - 1, 3, 30.0])]:
        flash3.forward_into(q, k, k, torch.empty_like(q), lse, 0.5, True, **opts)
        assert seen(12) == [680, 1, 0.5, *mask, 9, 12, 0x5000, 1, 0], opts
        flash3.backward_into(q, q, k, k, q, lse, torch.empty_like(q), torch.empty_like(k), torch.empty_like(k),
                             0.25, False, True, **opts)
        assert seen(11) == [776, 0, 1, 0.25, *mask, 12, 0x5000, 0], opts


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(window_left=1.5), r"^window_left: must be an int"),
    (dict(window_right="3"), r"^window_right: must be an int"),
    (dict(window_left=None), r"^window_left: must be an int"),
    (dict(window_right=-2**40), r"^window_right: must be >= 0, or -1"),
    (dict(softcap="30"), r"^softcap: must be a real number"),
    (dict(softcap=None), r"^softcap: must be a real number"),
    (dict(softcap=True), r"^softcap: must be a real number"),
    (dict(softcap=torch.tensor(30.0)), r"^softcap: must be a real number"),
    (dict(softcap=1e300), r"^softcap: 1e\+300 is not representable as a float32"),
    (dict(softcap=1e-50), r"^softcap: 1e-50 is not representable as a float32"),
], ids=["left_float", "right_str", "left_none", "right_below_int32", "softcap_str", "softcap_none", "softcap_bool",
        "softcap_tensor", "softcap_huge", "softcap_tiny"])
def test_cpu_window_and_softcap_types_rejected_before_any_launch(kwargs, pattern):
    """What the library cannot be given (a window side that is not an int, a softcap that is not
    a real number or that float32 cannot carry) raises ValueError naming it, in the forward and
    the backward, before any tensor is looked at (CPU tensors, no library needed)."""
    t = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match=pattern):
        flash3.forward_into(t, t, t, t, lse, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        flash3.backward_into(t, t, t, t, t, lse, t, t, t, **kwargs)
    # in range or not (the library's to say), a valid type gets as far as the tensors
    with pytest.raises(ValueError, match=r"^q: must be a CUDA tensor"):
        flash3.forward_into(t, t, t, t, lse, window_left=-7, window_right=2**40, softcap=-1.0)


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
