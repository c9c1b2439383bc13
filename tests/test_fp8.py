"""FP8 attention from PyTorch: the operators flash3::fwd_fp8 and flash3::quantize_fp8 (schemas,
fakes with static and symbolic shapes, opcheck, no autograd), flash_attn_func with float8_e4m3fn
inputs and FlashAttention-3's descales, flash3.quantize_fp8 and flash3.flash_attn_fp8_func,
errors naming the argument, torch.compile and CUDA graphs.

Tolerances (GPU):
  flash_attn_func FP8: max |out - fp64| <= 2 * max |plain - fp64| + 1e-3, fp64 the attention in
    float64 of the dequantized inputs, plain the same in float32 with P = exp(S - rowmax) rounded
    to e4m3 before P V and divided by the unrounded row sum, out rounded to bfloat16.
  flash_attn_fp8_func: the same rule against the whole pipeline emulated in torch (the block
    quantization of tests/stand_in.py, then plain), fp64 the attention of the 16-bit inputs; and
    on randn inputs RMSE <= 1e-2, max <= 0.2 (emulated at 1024 keys, head dim 128: about 2.7e-3
    and 0.04; 0.1 at 100 to 300 keys). On the outlier inputs of the FlashAttention-3 paper (N(0,1) + N(0,100) x
    Bernoulli(0.001)) the RMSE with hadamard=True is below the one without (emulated: 7.9e-3
    and 1.3e-2).
Tests named test_cpu_* run without a GPU (library calls stood in for on the CPU by
tests/stand_in.py where a kernel would run); the others need a Hopper GPU and libflash3.so.
Run: PYTHONPATH=python python3 -m pytest -q tests/test_fp8.py
"""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402
import stand_in  # noqa: E402
from test_torch import gpu, visible  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext  # noqa: E402

E4M3 = torch.float8_e4m3fn
FWD_FP8_SCHEMA = ("flash3::fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor? q_scale=None, Tensor? k_scale=None, "
                  "Tensor? v_scale=None, float? softmax_scale=None, bool causal=False, SymInt window_left=-1, "
                  "SymInt window_right=-1, float softcap=0.) -> (Tensor, Tensor)")
QUANTIZE_SCHEMA = ("flash3::quantize_fp8(Tensor x, SymInt block_rows=128, bool hadamard=False, SymInt seed=0) "
                   "-> (Tensor, Tensor)")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _randn(shape, device="cpu", dtype=torch.bfloat16, seed=0, outliers=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=device)
    if outliers:  # N(0, 1) + N(0, 100) x Bernoulli(0.001)
        x = x + 10 * torch.randn(shape, generator=gen, device=device) * (
            torch.rand(shape, generator=gen, device=device) < 0.001)
    return x.to(dtype)


def _descaled(x, heads_kv):
    """(x / descale rounded to e4m3, descale float32 (b, heads_kv)): one scale per (batch, kv
    head) as FlashAttention-3's descales, query heads grouped by the kv head they share."""
    b, s, h, d = x.shape
    amax = x.float().abs().reshape(b, s, heads_kv, h // heads_kv, d).amax(dim=(1, 3, 4))
    descale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    per_head = descale.repeat_interleave(h // heads_kv, dim=1)[:, None, :, None]
    return (x.float() / per_head).to(E4M3), descale


def _fp8_qkv(b, sq, sk, h, hk, d, device="cpu", seed=0):
    q, k, v = (_randn(shape, device, seed=seed + i) for i, shape in
               enumerate([(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)]))
    (qf, qs), (kf, ks), (vf, vs) = _descaled(q, hk), _descaled(k, hk), _descaled(v, hk)
    return qf, kf, vf, qs, ks, vs


# ---- registration and fakes ----------------------------------------------------------------------

def test_cpu_ops_registered_with_schemas():
    assert str(torch.ops.flash3.fwd_fp8.default._schema) == FWD_FP8_SCHEMA
    assert str(torch.ops.flash3.quantize_fp8.default._schema) == QUANTIZE_SCHEMA
    for op in (torch.ops.flash3.fwd_fp8.default, torch.ops.flash3.quantize_fp8.default):
        assert torch.Tag.pt2_compliant_tag in op.tags and not op._schema.is_mutable
    assert flash3._ops.fwd_fp8 is torch.ops.flash3.fwd_fp8.default
    assert flash3._ops.quantize_fp8 is torch.ops.flash3.quantize_fp8.default
    assert {"flash_attn_fp8_func", "quantize_fp8", "quantize_fp8_into"} <= set(flash3.__all__)


@pytest.mark.parametrize("shape", [(2, 128, 128, 8, 8, 128), (1, 17, 300, 6, 2, 64), (3, 1, 1000, 8, 1, 256)],
                         ids=["mha", "gqa", "mqa_decode"])
def test_cpu_fake_shapes(shape):
    b, sq, sk, h, hk, d = shape
    with FakeTensorMode():
        x = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="cuda")  # fake CUDA tensors: no GPU needed
        for rows in (64, 128, 1, 1000):
            out, scale = torch.ops.flash3.quantize_fp8(x, rows, True, 5)
            assert out.shape == x.shape and out.dtype == E4M3 and out.is_contiguous() and out.device == x.device
            assert scale.shape == (b, h, -(-sq // rows)) and scale.dtype == torch.float32 and scale.is_contiguous()
        xt = torch.empty(b, h, sq, d, dtype=torch.float16, device="cuda").transpose(1, 2)  # strided: out contiguous
        assert torch.ops.flash3.quantize_fp8(xt)[0].is_contiguous()
        q = torch.empty(b, sq, h, d, dtype=E4M3, device="cuda")
        k = torch.empty(b, sk, hk, d, dtype=E4M3, device="cuda")
        for scales in [(None, None, None),
                       tuple(torch.empty(b, hk, device="cuda") for _ in range(3)),
                       (torch.empty(b, h, -(-sq // 64), device="cuda"), torch.empty(b, hk, -(-sk // flash3.fp8.block_kv(d)), device="cuda"),
                        None)]:
            out, lse = torch.ops.flash3.fwd_fp8(q, k, k, *scales, 0.5, True)
            assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
            assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device
        # flash3::fwd with float8 q promises bfloat16 out too, as its kernel allocates
        assert torch.ops.flash3.fwd(q, k, k)[0].dtype == torch.bfloat16


def test_cpu_fake_shapes_symbolic():
    """Shape arithmetic only: every size symbolic, scale's blocks ceil(seqlen / block_rows)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def sym(*shape, dtype=torch.bfloat16):
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        return mode.from_tensor(torch.empty(*shape, dtype=dtype), symbolic_context=ctx)

    def exprs(sizes):
        return [n.node.expr if isinstance(n, torch.SymInt) else n for n in sizes]

    x = sym(2, 300, 4, 64)
    q, k = sym(2, 9, 4, 64, dtype=E4M3), sym(2, 12, 2, 64, dtype=E4M3)
    with mode:
        out, scale = torch.ops.flash3.quantize_fp8(x, 64, True, 1)
        o, lse = torch.ops.flash3.fwd_fp8(q, k, k, None, None, None, None, True)
    b, s, h, d = exprs(x.shape)
    assert exprs(out.shape) == [b, s, h, d] and exprs(out.stride()) == [s * h * d, h * d, d, 1]
    assert exprs(scale.shape)[:2] == [b, h]
    n = scale.shape[2]
    assert isinstance(n, torch.SymInt) and int(n.node.expr.subs(s, 300)) == 5 and int(n.node.expr.subs(s, 320)) == 5
    assert int(n.node.expr.subs(s, 321)) == 6
    bq, sq, hq, dq = exprs(q.shape)
    assert exprs(o.shape) == [bq, sq, hq, dq] and o.dtype == torch.bfloat16
    assert exprs(lse.shape) == [bq, hq, sq]


def test_cpu_compile_dynamic_shapes(calls):
    """flash_attn_fp8_func and FP8 flash_attn_func under torch.compile(dynamic=True,
    fullgraph=True): the same results as eager (stand-ins), across sequence lengths."""
    def f(q, k, v):
        return flash3.flash_attn_fp8_func(q, k, v, causal=True, seed=3)

    def g(q, k, v, qs, ks, vs):
        return flash3.flash_attn_func(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, return_attn_probs=True)

    cf = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
    cg = torch.compile(g, backend="eager", dynamic=True, fullgraph=True)
    for s in (70, 130):
        q, k, v = _randn((2, s, 4, 64), seed=1), _randn((2, s + 5, 2, 64), seed=2), _randn((2, s + 5, 2, 64), seed=3)
        assert torch.equal(cf(q, k, v), f(q, k, v))
        args = _fp8_qkv(2, s, s + 5, 4, 2, 64, seed=s)
        for got, want in zip(cg(*args), g(*args)):
            assert torch.equal(got, want)


# opcheck's test_schema (SchemaCheckMode) compares the inputs before and after the call with
# torch.allclose, which float8 tensors do not implement ("mul_cpu_reduced_float" not implemented
# for 'Float8_e4m3fn'): fwd_fp8, whose inputs are float8, is checked without it (the operator is
# functional: mutates_args=(), asserted in test_cpu_ops_registered_with_schemas).
FWD_FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_both(device):
    x = _randn((2, 150, 4, 64), device, seed=4)
    for kwargs in (dict(), dict(block_rows=64, hadamard=True, seed=9)):
        torch.library.opcheck(torch.ops.flash3.quantize_fp8.default, (x,), kwargs)
    qf, kf, vf, qs, ks, vs = _fp8_qkv(2, 9, 12, 4, 2, 64, device)
    torch.library.opcheck(torch.ops.flash3.fwd_fp8.default, (qf, kf, vf, qs, ks, vs), dict(causal=True),
                          test_utils=FWD_FP8_OPCHECK)
    torch.library.opcheck(torch.ops.flash3.fwd_fp8.default, (qf, kf, vf), dict(softmax_scale=0.2),
                          test_utils=FWD_FP8_OPCHECK)


def test_cpu_opcheck_with_stand_in(calls):
    """torch.library.opcheck (schema, fake vs real, AOT dispatch with dynamic shapes) with the CPU
    stand-ins as the kernels; no input requires grad (the ops have no autograd)."""
    _opcheck_both("cpu")


# ---- paths and arguments (CPU stand-ins) --------------------------------------------------------

def test_cpu_flash_attn_func_passes_descales_as_scales(calls):
    """Eager FP8 flash_attn_func runs the kernel directly, each descale as the library's scale
    of the same tensor; out is bfloat16."""
    qf, kf, vf, qs, ks, vs = _fp8_qkv(2, 33, 40, 4, 2, 64)
    out, lse = flash3.flash_attn_func(qf, kf, vf, 0.3, True, q_descale=qs, k_descale=ks, v_descale=vs,
                                      return_attn_probs=True)
    (name, c), = calls
    assert name == "fwd" and c["q_scale"] is qs and c["k_scale"] is ks and c["v_scale"] is vs
    assert (c["softmax_scale"], c["causal"]) == (0.3, True)
    assert out.dtype == torch.bfloat16 and out.shape == qf.shape and lse.shape == (2, 4, 33)
    ref, _ = stand_in.attention(stand_in.dequantize(qf, qs, 64, 2), stand_in.dequantize(kf, ks, 128, 2),
                                stand_in.dequantize(vf, vs, 128, 2), 0.3, True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-2)
    # no descales: scales of 1
    calls.clear()
    assert flash3.flash_attn_func(qf, kf, vf).dtype == torch.bfloat16
    assert calls[0][1]["q_scale"] is None
    # packed FP8 qkv: the same path
    qkv = torch.stack([qf.float(), qf.float(), qf.float()], dim=2).to(E4M3)
    one = torch.ones(2, 4)
    assert flash3.flash_attn_qkvpacked_func(qkv, q_descale=one).dtype == torch.bfloat16


def test_cpu_flash_attn_func_fp8_passes_the_window(calls):
    """FP8 flash_attn_func hands the window and softcap to the library (which refuses both for
    float8 inputs, but (-1, 0), which is causal), eagerly and through flash3::fwd_fp8 (under
    FakeTensorMode too); the fake library here computes the stand-in."""
    qf, kf, vf, qs, ks, vs = _fp8_qkv(1, 40, 57, 4, 2, 64)
    out = flash3.flash_attn_func(qf, kf, vf, window_size=(6, 2), q_descale=qs, k_descale=ks, v_descale=vs)
    c = calls[-1][1]
    assert (c["causal"], c["window_left"], c["window_right"], c["softcap"]) == (False, 6, 2, 0.0)
    ref, _ = stand_in.attention(stand_in.dequantize(qf, qs, 64, 2), stand_in.dequantize(kf, ks, 128, 2),
                                stand_in.dequantize(vf, vs, 128, 2), None, False, (6, 2))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-2)
    out2, _ = torch.ops.flash3.fwd_fp8(qf, kf, vf, qs, ks, vs, None, False, 6, 2)
    assert torch.equal(out, out2) and calls[-1][1]["window_left"] == 6
    flash3.flash_attn_func(qf, kf, vf, causal=True, window_size=(9, 4), softcap=3.0)
    c = calls[-1][1]
    assert (c["causal"], c["window_left"], c["window_right"], c["softcap"]) == (True, 9, -1, 3.0)
    with FakeTensorMode():
        q = torch.empty(1, 40, 4, 64, dtype=E4M3, device="cuda")
        o, lse = torch.ops.flash3.fwd_fp8(q, q[:, :, :2], q[:, :, :2], None, None, None, None, True, 9, -1)
        assert o.shape == q.shape and o.dtype == torch.bfloat16 and lse.shape == (1, 4, 40)


def test_cpu_flash_attn_fp8_func_quantizes_then_runs_fp8(calls):
    """q in blocks of 64 rows and k in 192 (block_kv(128)), both rotated with the same seed; v in
    192 without rotation; the forward gets the block scales. The rotation leaves the result
    unchanged."""
    q, k, v = _randn((2, 100, 4, 128), seed=5), _randn((2, 200, 2, 128), seed=6), _randn((2, 200, 2, 128), seed=7)
    out, lse = flash3.flash_attn_fp8_func(q, k, v, causal=True, seed=11, return_attn_probs=True)
    quant = [c for n, c in calls if n == "quantize"]
    assert [(c["x"] is t, c["block_rows"], c["hadamard"], c["seed"]) for c, t in zip(quant, (q, k, v))] == [
        (True, 64, True, 11), (True, 192, True, 11), (True, 192, False, 0)]
    (fwd,) = [c for n, c in calls if n == "fwd"]
    assert fwd["q"].dtype == E4M3 and fwd["q_scale"].shape == (2, 4, 2) and fwd["k_scale"].shape == (2, 2, 2)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 4, 100)
    # the stand-in's result is the attention of the dequantized blocks (P is not rounded here)
    parts = [stand_in.dequantize(*stand_in.quantize(t, blk, rot, seed), blk, 2)
             for t, blk, rot, seed in ((q, 64, True, 11), (k, 192, True, 11), (v, 192, False, 0))]
    torch.testing.assert_close(out.double(), stand_in.attention(*parts, None, True)[0], rtol=0, atol=1e-2)
    # and within FP8 error of the 16-bit inputs' attention, rotated or not
    ref, _ = stand_in.attention(q, k, v, None, True)
    plain = flash3.flash_attn_fp8_func(q, k, v, causal=True, hadamard=False)
    for o in (out, plain):
        assert (o.double() - ref).pow(2).mean().sqrt().item() <= 1e-2


def test_cpu_quantize_direct_and_operator_agree(calls):
    x = _randn((1, 130, 2, 64), seed=8)
    out, scale = flash3.quantize_fp8(x, 64, True, 2)
    assert calls[-1][1]["block_rows"] == 64 and scale.shape == (1, 2, 3)
    out2, scale2 = torch.ops.flash3.quantize_fp8(x, 64, True, 2)
    assert torch.equal(out.view(torch.uint8), out2.view(torch.uint8)) and torch.equal(scale, scale2)


def test_cpu_backward_through_fp8_raises(calls):
    """FP8 is inference-only: with an input that requires grad, the call records the operators,
    and a backward raises naming the operator (rather than finding no graph)."""
    q, k, v = (_randn((1, 64, 2, 64), seed=i).requires_grad_() for i in range(3))
    out = flash3.flash_attn_fp8_func(q, k, v)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="flash3.*(quantize_fp8|fwd_fp8).*no autograd formula"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not flash3.flash_attn_fp8_func(q, k, v).requires_grad


# ---- bad inputs, refused before the library is called (CPU and meta tensors) ----------------------

def _e4m3(*shape):
    return torch.zeros(shape, dtype=E4M3)


@pytest.mark.parametrize("case, pattern", [
    (dict(k=torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)), r"^k: dtype torch.bfloat16 but q is torch.float8_e4m3fn"),
    (dict(v=torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)), r"^v: dtype torch.bfloat16"),
    (dict(q=torch.zeros(1, 16, 2, 64, dtype=torch.float8_e5m2)), r"^q: dtype torch.float8_e5m2 is not supported"),
    (dict(k=torch.zeros(1, 16, 2, 64, dtype=torch.float8_e5m2)), r"^k: dtype torch.float8_e5m2"),
    (dict(q_descale=torch.ones(1, 2, dtype=torch.float64)), r"^q_descale: dtype torch.float64.*float32"),
    (dict(k_descale=torch.ones(1, 4)), r"^k_descale: shape \(1, 4\), expected \(batch, nheads_kv\) = \(1, 2\)"),
    (dict(v_descale=torch.ones(1, 2, device="meta")), r"^v_descale: on device meta but q is on cpu"),
    (dict(q_descale=1.0), r"^q_descale: expected a torch.Tensor"),
], ids=["k_bf16", "v_bf16", "q_e5m2", "k_e5m2", "descale_dtype", "descale_shape", "descale_device", "descale_float"])
def test_cpu_flash_attn_func_fp8_bad_inputs(case, pattern):
    args = dict(q=_e4m3(1, 16, 4, 64), k=_e4m3(1, 16, 2, 64), v=_e4m3(1, 16, 2, 64))
    args.update(case)
    with pytest.raises(ValueError, match=pattern):
        flash3.flash_attn_func(**args)


@pytest.mark.parametrize("case, pattern", [
    (dict(k=torch.zeros(1, 16, 2, 64, dtype=torch.float16)), r"^k: dtype torch.float16 but q is torch.bfloat16"),
    (dict(q=_e4m3(1, 16, 2, 64)), r"^q: dtype torch.float8_e4m3fn is not supported.*flash_attn_func"),
    (dict(v=torch.zeros(1, 16, 2, 64)), r"^v: dtype torch.float32"),
    (dict(q=torch.zeros(1, 16, 2, 96, dtype=torch.bfloat16)), r"^q: head dim 96 is not supported.*hadamard"),
    (dict(k=torch.zeros(16, 2, 64, dtype=torch.bfloat16)), r"^k: expected \(batch, seqlen, nheads, headdim\)"),
    (dict(seed=-1), r"^seed: must be in \[0, 2\^63\), got -1"),
    (dict(seed=2**64), r"^seed:"),
], ids=["mixed_16bit", "fp8_q", "fp32_v", "hdim96_hadamard", "rank", "negative_seed", "huge_seed"])
def test_cpu_flash_attn_fp8_func_bad_inputs(case, pattern):
    args = dict(q=torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16), k=torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16),
                v=torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16))
    args.update(case)
    with pytest.raises(ValueError, match=pattern):
        flash3.flash_attn_fp8_func(**args)


def test_cpu_quantize_and_operator_bad_inputs():
    x = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    for rows in (0, -64):
        with pytest.raises(ValueError, match=rf"^block_rows: must be >= 1.*got {rows}"):
            flash3.quantize_fp8(x, rows)
    with pytest.raises(ValueError, match=r"^x: expected \(batch, seqlen, nheads, head_dim\)"):
        flash3.quantize_fp8(x[0])
    with pytest.raises(ValueError, match=r"^x: expected a torch.Tensor"):
        flash3.quantize_fp8([1.0])
    with FakeTensorMode():  # the fakes name the argument too (errors at trace time)
        q = torch.empty(1, 16, 2, 64, dtype=E4M3, device="cuda")
        with pytest.raises(ValueError, match=r"^q: dtype torch.float8_e5m2"):
            torch.ops.flash3.fwd_fp8(q.to(torch.float8_e5m2), q, q)
        with pytest.raises(ValueError, match=r"^k_scale: dtype torch.float16"):
            torch.ops.flash3.fwd_fp8(q, q, q, None, torch.ones(1, 2, dtype=torch.float16, device="cuda"))
        with pytest.raises(ValueError, match=r"^block_rows: must be >= 1"):
            torch.ops.flash3.quantize_fp8(torch.empty(1, 16, 2, 64, dtype=torch.bfloat16, device="cuda"), 0)


# ---- on a Hopper GPU ---------------------------------------------------------------------------------

def _attention64(q, k, v, scale, causal):
    """(out, lse) in float64 (tests/stand_in.py: rows that see no key give 0 and +inf)."""
    return stand_in.attention(q, k, v, scale, causal)


def _plain_fp8(q, k, v, scale, causal):
    """The FP8 forward emulated in float32 from dequantized q, k, v: P = exp(S - rowmax) rounded to
    e4m3 before P V, divided by the unrounded row sum; out rounded to bfloat16 (0 for a row that
    sees no key)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.float().repeat_interleave(rep, 2), v.float().repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    if causal:
        s = s.masked_fill(~visible(q.shape[1], k.shape[1], q.device, causal), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(E4M3).float() / torch.where(l > 0, l, torch.ones_like(l)), v)
    return o.to(torch.bfloat16)


def _max_err(a, ref):
    return (a.double() - ref).abs().max().item()


FP8_SHAPES = [(1, 128, 128, 4, 4), (2, 200, 300, 4, 2), (1, 1000, 129, 4, 4), (2, 1, 1000, 8, 1)]


@gpu
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_flash_attn_func_fp8_descales(hdim, causal, shape):
    b, sq, sk, h, hk = shape
    qf, kf, vf, qs, ks, vs = _fp8_qkv(b, sq, sk, h, hk, hdim, "cuda", seed=hdim + sq)
    out, lse = flash3.flash_attn_func(qf, kf, vf, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs,
                                      return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == qf.shape and lse.shape == (b, h, sq)
    qd, kd, vd = (stand_in.dequantize(t, s, 0, hk) for t, s in ((qf, qs), (kf, ks), (vf, vs)))
    scale = hdim ** -0.5
    ref, ref_lse = _attention64(qd, kd, vd, scale, causal)
    plain = _plain_fp8(qd, kd, vd, scale, causal)
    err, err_plain = _max_err(out, ref), _max_err(plain, ref)
    assert err <= 2 * err_plain + 1e-3, f"max abs err {err:.3e} > 2 * plain {err_plain:.3e} + 1e-3"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse.double() - ref_lse)[finite].abs().max().item() <= 1e-3 * max(1.0, ref_lse[finite].abs().max().item())
    # the same call through the operator: the same bits
    out2, lse2 = torch.ops.flash3.fwd_fp8(qf, kf, vf, qs, ks, vs, None, causal)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@gpu
@pytest.mark.parametrize("window, causal", [((0, 0), False), ((100, 0), False), ((-1, 37), False), ((5, 3), True)],
                         ids=["w0_0", "w100_0", "right37", "w5_causal"])
def test_flash_attn_func_fp8_window_is_refused(window, causal):
    """Sliding windows are built for 16-bit inputs only: an FP8 call with one raises the library's
    ValueError naming the window, before anything runs; (-1, 0) is causal and runs."""
    qf, kf, vf, qs, ks, vs = _fp8_qkv(1, 300, 517, 4, 2, 128, "cuda", seed=window[0] + 7)
    with pytest.raises(ValueError, match="window_left is .* but q.dtype is float8_e4m3; sliding windows are built"):
        flash3.flash_attn_func(qf, kf, vf, causal=causal, window_size=window, q_descale=qs, k_descale=ks, v_descale=vs)
    out = flash3.flash_attn_func(qf, kf, vf, window_size=(-1, 0), q_descale=qs, k_descale=ks, v_descale=vs)
    ref = flash3.flash_attn_func(qf, kf, vf, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    assert torch.equal(out, ref)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_quantize_matches_reference_without_rotation(hdim, dtype):
    """hadamard=False: bitwise the torch reference (scale = amax / 448 rounded once to float32, 1
    for a zero block; out = x * float32(448 / amax) rounded to e4m3), strided input, a zero
    block, and seqlen not a multiple of the block."""
    x = _randn((2, 4, 300, hdim), "cuda", dtype, seed=hdim).transpose(1, 2)  # (b, s, h, d) view
    x[:, 128:256, 1] = 0
    for rows in (64, 128):
        out, scale = flash3.quantize_fp8(x, rows)
        ref_out, ref_scale = stand_in.quantize(x, rows)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8))
    assert (scale[:, 1, 1] == 1).all()


@gpu
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_quantize_hadamard_invariants(hdim):
    """hadamard=True: every nonzero block's max |out| is 448 (scale = the rotated block's amax /
    448); out * scale is x rotated by M = diag(s) H / sqrt(d) (signs of src/quant/hadamard.h)
    within e4m3 rounding; q k^T is kept with one seed and lost with two."""
    b, s, h = 2, 300, 4
    q, k = _randn((b, s, h, hdim), "cuda", seed=1, outliers=True), _randn((b, s, h, hdim), "cuda", seed=2)
    qf, qs = flash3.quantize_fp8(q, 64, True, 7)
    kf, ks = flash3.quantize_fp8(k, 128, True, 7)
    kf2, ks2 = flash3.quantize_fp8(k, 128, True, 8)
    nb = qs.shape[2]
    blockmax = torch.zeros(b, h, nb, device="cuda")
    rows = torch.arange(s, device="cuda") // 64
    amax_row = qf.float().abs().amax(dim=3).transpose(1, 2)  # (b, h, s)
    blockmax.scatter_reduce_(2, rows.expand(b, h, s), amax_row, reduce="amax")
    assert (blockmax == 448).all()
    m = stand_in.hadamard_matrix(hdim, 7).cuda()
    rotated = q.double() @ m
    deq = stand_in.dequantize(qf, qs, 64, h)
    rot_amax = torch.zeros(b, h, nb, device="cuda", dtype=torch.float64)
    rot_amax.scatter_reduce_(2, rows.expand(b, h, s), rotated.abs().amax(dim=3).transpose(1, 2), reduce="amax")
    torch.testing.assert_close(qs.double(), rot_amax / 448, rtol=1e-5, atol=0)
    unit = qs.double()[:, :, rows].transpose(1, 2)[..., None]  # each element's scale
    assert ((deq - rotated).abs() <= (2**-4 * rotated.abs() + 2**-9 * unit) * 1.01).all()
    # q k^T: kept with the same seed (within FP8 error), not with another
    ref = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    kd, kd2 = stand_in.dequantize(kf, ks, 128, h), stand_in.dequantize(kf2, ks2, 128, h)
    rel = (torch.einsum("bqhd,bkhd->bhqk", deq, kd) - ref).norm() / ref.norm()
    rel2 = (torch.einsum("bqhd,bkhd->bhqk", deq, kd2) - ref).norm() / ref.norm()
    assert rel < 0.1 and rel2 > 0.5, (rel.item(), rel2.item())


def _pipeline_emulated(q, k, v, causal, hadamard, seed=0):
    """flash_attn_fp8_func emulated in torch: stand_in.quantize (the kernel's block
    quantization), then _plain_fp8 on the dequantized (rotated) q, k and v."""
    hk, blk_kv = k.shape[2], flash3.fp8.block_kv(k.shape[3])
    qf, qs = stand_in.quantize(q.cpu(), 64, hadamard, seed)
    kf, ks = stand_in.quantize(k.cpu(), blk_kv, hadamard, seed)
    vf, vs = stand_in.quantize(v.cpu(), blk_kv, False, 0)
    parts = [stand_in.dequantize(t, s, blk, hk).to(q.device)
             for t, s, blk in ((qf, qs, 64), (kf, ks, blk_kv), (vf, vs, blk_kv))]
    return _plain_fp8(*parts, q.shape[-1] ** -0.5, causal)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_flash_attn_fp8_func_accuracy(hdim, causal):
    b, sq, sk, h, hk = 2, 300, 1024, 4, 2
    q, k, v = (_randn(shape, "cuda", seed=i + hdim) for i, shape in
               enumerate([(b, sq, h, hdim), (b, sk, hk, hdim), (b, sk, hk, hdim)]))
    ref, _ = _attention64(q, k, v, None, causal)
    for hadamard in (True, False):
        out = flash3.flash_attn_fp8_func(q, k, v, causal=causal, hadamard=hadamard, seed=5)
        assert out.dtype == torch.bfloat16
        err = _max_err(out, ref)
        rmse = (out.double() - ref).pow(2).mean().sqrt().item()
        err_emul = _max_err(_pipeline_emulated(q, k, v, causal, hadamard, seed=5), ref)
        assert err <= 2 * err_emul + 1e-3, f"hadamard={hadamard}: max abs err {err:.3e} > 2 * emulated {err_emul:.3e} + 1e-3"
        assert rmse <= 1e-2 and err <= 0.2, (hadamard, rmse, err)


@gpu
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_hadamard_lowers_the_error_on_outliers(hdim):
    """The FlashAttention-3 paper's outlier inputs: RMSE against fp64 with and without the
    rotation (both printed; run with -s to see them)."""
    b, s, h = 1, 2048, 4
    q, k, v = (_randn((b, s, h, hdim), "cuda", seed=i, outliers=True) for i in range(3))
    ref, _ = _attention64(q, k, v, None, False)
    rmse = {}
    for hadamard in (True, False):
        out = flash3.flash_attn_fp8_func(q, k, v, hadamard=hadamard, seed=1)
        rmse[hadamard] = (out.double() - ref).pow(2).mean().sqrt().item()
    bf16 = flash3.flash_attn_func(q, k, v)
    print(f"\nhead dim {hdim}: FP8 RMSE with hadamard {rmse[True]:.3e}, without {rmse[False]:.3e}, "
          f"bf16 {(bf16.double() - ref).pow(2).mean().sqrt().item():.3e}")
    assert rmse[True] < rmse[False]


@gpu
def test_opcheck_cuda():
    _opcheck_both("cuda")


@gpu
def test_fp8_bad_inputs_reach_the_user_from_the_library():
    """Errors the library finds name the argument: a scale of the wrong shape or dtype, a scale
    on the host, a scale with 16-bit inputs, an unsupported head dim for the quantizer."""
    qf, kf, vf, qs, ks, vs = _fp8_qkv(1, 100, 100, 4, 2, 128, "cuda")
    with pytest.raises(ValueError, match=r"q_scale\.shape\[1\] is 3"):
        torch.ops.flash3.fwd_fp8(qf, kf, vf, torch.ones(1, 3, device="cuda"))
    with pytest.raises(ValueError, match=r"k_scale\.dtype is float16"):
        torch.ops.flash3.fwd_fp8(qf, kf, vf, None, ks.half())
    with pytest.raises(ValueError, match=r"^v_scale: must be a CUDA tensor"):
        torch.ops.flash3.fwd_fp8(qf, kf, vf, None, None, vs.cpu())
    q16 = torch.zeros(1, 100, 4, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q16)
    with pytest.raises(ValueError, match=r"q_scale is given but q\.dtype is bfloat16"):
        flash3.forward_into(q16, q16[:, :, :2], q16[:, :, :2], out, q_scale=qs)
    with pytest.raises(ValueError, match=r"float8_e5m2"):
        flash3.forward_into(qf.view(torch.float8_e5m2), kf, vf, out)
    with pytest.raises(ValueError, match=r"in\.shape\[3\] \(head_dim\) is 96.*\(in: the argument x\)"):
        flash3.quantize_fp8(torch.zeros(1, 100, 4, 96, device="cuda", dtype=torch.bfloat16))


@gpu
def test_compile_fullgraph_matches_eager_and_cuda_graph():
    q, k, v = (_randn(shape, "cuda", seed=i) for i, shape in enumerate([(2, 300, 4, 128), (2, 500, 2, 128),
                                                                         (2, 500, 2, 128)]))

    def f(q, k, v):
        return flash3.flash_attn_fp8_func(q, k, v, causal=True, seed=4, return_attn_probs=True)

    def g(q, k, v, qs, ks, vs):
        return flash3.flash_attn_func(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, causal=True)

    eager = f(q, k, v)
    for got, want in zip(torch.compile(f, fullgraph=True)(q, k, v), eager):
        assert torch.equal(got, want)
    fp8 = _fp8_qkv(2, 300, 500, 4, 2, 128, "cuda", seed=3)
    assert torch.equal(torch.compile(g, fullgraph=True)(*fp8), g(*fp8))
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        got = [t.clone() for t in cf(q, k, v)]
    torch.cuda.synchronize()
    for a, b_ in zip(got, eager):
        assert torch.equal(a, b_)
