"""flash3's torch.library operators (python/flash3/_ops.py): registration, fake implementations
(static and symbolic shapes), torch.library.opcheck, autograd wiring, and which path a call
takes (the kernels directly in eager mode, the operators under tracing).

Tests named test_cpu_* run without a GPU (the library calls stood in for by the math on the
CPU where a kernel runs: tests/stand_in.py); the others need a Hopper GPU and libflash3.so.
Run: PYTHONPATH=python python3 -m pytest -q tests/test_ops.py
"""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402
import stand_in  # noqa: E402
from test_torch import check, check_grads, gpu, randn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext  # noqa: E402

MASK_ARGS = "SymInt window_left=-1, SymInt window_right=-1, float softcap=0."  # appended: earlier calls still work
FWD_SCHEMA = ("flash3::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
              f"bool deterministic=False, {MASK_ARGS}) -> (Tensor, Tensor)")
BWD_SCHEMA = ("flash3::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
              f"float? softmax_scale=None, bool causal=False, bool deterministic=False, {MASK_ARGS}) "
              "-> (Tensor, Tensor, Tensor)")


def _qkv(b=2, sq=9, sk=12, h=4, hk=2, d=16, dtype=torch.float32, device="cpu", seed=0, grad=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, device=device).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=gen, device=device).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=gen, device=device).to(dtype)
    return tuple(t.requires_grad_() for t in (q, k, v)) if grad else (q, k, v)


# ---- registration ----------------------------------------------------------------------------

def test_cpu_ops_registered_with_schemas():
    assert hasattr(torch.ops.flash3, "fwd") and hasattr(torch.ops.flash3, "bwd")
    assert str(torch.ops.flash3.fwd.default._schema) == FWD_SCHEMA
    assert str(torch.ops.flash3.bwd.default._schema) == BWD_SCHEMA
    for op in (torch.ops.flash3.fwd.default, torch.ops.flash3.bwd.default):
        assert torch.Tag.pt2_compliant_tag in op.tags
        assert not op._schema.is_mutable  # functional: no copies under functionalization
    # FP8: tests/test_fp8.py; varlen: tests/test_varlen.py; KV cache: tests/test_kvcache.py
    assert list(flash3._ops.OPS) == ["fwd", "bwd", "fwd_fp8", "quantize_fp8", "fwd_varlen", "bwd_varlen",
                                     "fwd_kvcache"]
    assert flash3._ops.fwd is torch.ops.flash3.fwd.default and flash3._ops.bwd is torch.ops.flash3.bwd.default


def test_cpu_import_and_registration_need_no_library(tmp_path):
    """import flash3 registers the operators without loading libflash3.so (loaded at the first
    real call), also where there is none."""
    code = ("import torch, flash3; assert flash3._lib._lib is None; "
            "assert torch.ops.flash3.fwd.default and torch.ops.flash3.bwd.default; "
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    q = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16)\n"
            "    out, lse = torch.ops.flash3.fwd(q, q, q)\n"
            "assert flash3._lib._lib is None and tuple(lse.shape) == (1, 2, 8)\n"
            "print(flash3.hopper_available()[0])")
    env = dict(os.environ, FLASH3_LIB=str(tmp_path / "no_such_libflash3.so"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(flash3.__path__[0]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("False")


# ---- fake implementations --------------------------------------------------------------------

def _check_fwd_meta(q, out, lse):
    b, sq, h, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 128, 128, 8, 8, 128), (1, 17, 300, 6, 2, 64), (3, 1, 1000, 8, 1, 256)],
                         ids=["mha", "gqa", "mqa_decode"])
def test_cpu_fake_shapes(shape, dtype):
    b, sq, sk, h, hk, d = shape
    with FakeTensorMode():
        q = torch.empty(b, sq, h, d, dtype=dtype, device="cuda")  # fake CUDA tensors: no GPU needed
        k = torch.empty(b, sk, hk, d, dtype=dtype, device="cuda")
        v = torch.empty(b, sk, hk, d, dtype=dtype, device="cuda")
        out, lse = torch.ops.flash3.fwd(q, k, v, None, True)
        _check_fwd_meta(q, out, lse)
        assert out.device == q.device and lse.device == q.device
        dq, dk, dv = torch.ops.flash3.bwd(out, q, k, v, out, lse)
        for g, t in zip((dq, dk, dv), (q, k, v)):
            assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous() and g.device == t.device
        # strided inputs (a (b, h, s, d) view, a padded row): the outputs are still contiguous
        qt = torch.empty(b, h, sq, d, dtype=dtype, device="cuda").transpose(1, 2)
        kp = torch.empty(b, sk, hk, d + 8, dtype=dtype, device="cuda")[..., :d]
        out, lse = torch.ops.flash3.fwd(qt, kp, kp)
        _check_fwd_meta(qt, out, lse)
        assert all(g.is_contiguous() for g in torch.ops.flash3.bwd(out, qt, kp, kp, out, lse))


@pytest.mark.parametrize("mask", [dict(window_left=128, window_right=0), dict(window_left=-1, window_right=37),
                                  dict(softcap=30.0), dict(window_left=5, window_right=3, softcap=1.0)],
                         ids=["window_left", "window_right", "softcap", "window_softcap"])
@pytest.mark.parametrize("shape", [(2, 300, 517, 8, 2, 128), (1, 517, 300, 6, 6, 64)], ids=["gqa", "sq_gt_sk"])
def test_cpu_fake_shapes_with_window_and_softcap(shape, mask):
    """The fakes of fwd and bwd with a window and softcap (positional and keyword): the shapes,
    dtypes and layouts of the plain call."""
    b, sq, sk, h, hk, d = shape
    args = (mask.get("window_left", -1), mask.get("window_right", -1), mask.get("softcap", 0.0))
    with FakeTensorMode():
        q = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(b, sk, hk, d, dtype=torch.bfloat16, device="cuda")
        for out, lse in (torch.ops.flash3.fwd(q, k, k, None, False, False, *args),
                         torch.ops.flash3.fwd(q, k, k, causal=True, **mask)):
            _check_fwd_meta(q, out, lse)
            for dq, dk, dv in (torch.ops.flash3.bwd(out, q, k, k, out, lse, 0.5, True, True, *args),
                               torch.ops.flash3.bwd(out, q, k, k, out, lse, **mask)):
                for g, t in zip((dq, dk, dv), (q, k, k)):
                    assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous() and g.device == t.device


def test_cpu_fake_rejects_bad_window_and_softcap_types():
    """Under FakeTensorMode (tracing) a window or softcap of the wrong type is refused naming the
    argument: by the schema for what it cannot convert, by the fakes as by the kernels for the
    rest (a window side below int32)."""
    with FakeTensorMode():
        q = torch.empty(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
        for kwargs, name in [(dict(window_left=1.5), "window_left"), (dict(window_right="2"), "window_right"),
                             (dict(softcap="30"), "softcap")]:
            with pytest.raises((RuntimeError, TypeError, ValueError), match=rf"\b{name}\b"):
                torch.ops.flash3.fwd(q, q, q, **kwargs)
            with pytest.raises((RuntimeError, TypeError, ValueError), match=rf"\b{name}\b"):
                torch.ops.flash3.bwd(q, q, q, q, q, q[:, 0], **kwargs)
        with pytest.raises(ValueError, match=r"^window_left: must be >= 0, or -1"):
            torch.ops.flash3.fwd(q, q, q, window_left=-2**40)


def test_cpu_fake_shapes_symbolic():
    """The fakes use shape arithmetic only: every size symbolic, the outputs' sizes are the
    inputs' symbols."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def sym(*shape):
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        return mode.from_tensor(torch.empty(*shape, dtype=torch.bfloat16), symbolic_context=ctx)

    q, k, v = sym(2, 9, 4, 64), sym(2, 12, 2, 64), sym(2, 12, 2, 64)
    assert all(isinstance(n, torch.SymInt) for n in q.shape)
    with mode:
        out, lse = torch.ops.flash3.fwd(q, k, v, 0.5, True, False)
        dq, dk, dv = torch.ops.flash3.bwd(out, q, k, v, out, lse, 0.5, True, False)
        out2, lse2 = torch.ops.flash3.fwd(q, k, v, 0.5, False, False, 16, 3, 20.0)
        grads2 = torch.ops.flash3.bwd(out2, q, k, v, out2, lse2, 0.5, False, False, 16, 3, 20.0)

    def exprs(sizes):
        return [n.node.expr if isinstance(n, torch.SymInt) else n for n in sizes]

    b, sq, h, d = exprs(q.shape)
    assert exprs(out.shape) == [b, sq, h, d] and exprs(out.stride()) == [sq * h * d, h * d, d, 1]
    assert exprs(lse.shape) == [b, h, sq] and exprs(lse.stride()) == [h * sq, sq, 1]
    assert lse.dtype == torch.float32
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert exprs(g.shape) == exprs(t.shape) and g.is_contiguous()
    assert exprs(out2.shape) == exprs(out.shape) and exprs(lse2.shape) == exprs(lse.shape)
    for g, t in zip(grads2, (q, k, v)):
        assert exprs(g.shape) == exprs(t.shape) and g.is_contiguous()


def test_cpu_fake_rejects_bad_rank_naming_q():
    with FakeTensorMode():
        q = torch.empty(8, 2, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"\bq\b"):
            torch.ops.flash3.fwd(q, q, q)


def test_cpu_make_fx_traces_the_operator_not_the_library(calls):
    """Under make_fx (a dispatch mode, symbolic shapes) flash_attn_func records flash3::fwd and
    the backward flash3::bwd; the library is not called while tracing."""
    q, k, v = _qkv()

    def f(q, k, v):
        return flash3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)

    g = make_fx(f, tracing_mode="symbolic")(q, k, v)
    targets = [n.target for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.flash3.fwd.default in targets and not calls
    out, lse = g(q, k, v)  # the traced graph runs the operator
    ref, ref_lse = stand_in.attention(q, k, v, None, True)
    assert torch.allclose(out.double(), ref, atol=1e-5) and torch.allclose(lse.double(), ref_lse, atol=1e-5)

    def fb(q, k, v, dout):
        out = flash3.flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    calls.clear()
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = make_fx(fb, tracing_mode="fake")(qg, kg, vg, torch.randn_like(q))
    targets = [n.target for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.flash3.fwd.default in targets and torch.ops.flash3.bwd.default in targets and not calls


# ---- which path a call takes -----------------------------------------------------------------

def test_cpu_direct_only_where_nothing_traces():
    q, k, v = _qkv()
    assert flash3._ops.direct(q, k, v)
    assert not flash3._ops.direct(q, torch.nn.Parameter(k), v)  # a subclass
    with FakeTensorMode() as mode:
        assert not flash3._ops.direct(q, k, v)
    fq = mode.from_tensor(q)
    assert not flash3._ops.direct(fq, k, v)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        seen.append(flash3._ops.direct(x))
        return x + 1

    f(q)
    assert seen == [False]


def test_cpu_eager_calls_skip_the_dispatcher(calls, monkeypatch):
    """Eager flash_attn_func runs the kernels without the operators (host time), forward and
    backward; torch.ops.flash3.fwd called by hand works too, through the same kernels."""
    entered = []
    for name in ("_fwd", "_bwd"):
        original = getattr(flash3._ops, name)
        monkeypatch.setitem(flash3._ops.OPS[name[1:]]._backend_fns, None,
                            lambda *a, _o=original, _n=name, **kw: (entered.append(_n), _o(*a, **kw))[1])
    q, k, v = _qkv(grad=True)
    flash3.flash_attn_func(q, k, v, causal=True).sum().backward()
    assert [name for name, _ in calls] == ["fwd", "bwd"] and entered == []
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out, lse = torch.ops.flash3.fwd(q, k, v, causal=True)
    assert out.requires_grad and not lse.requires_grad
    out.sum().backward()
    assert entered == ["_fwd"]  # the backward of an eager call runs the kernel directly
    for g, t in zip(grads, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_cpu_operator_autograd(calls):
    """torch.ops.flash3.fwd is differentiable in q, k, v: its backward hands the forward's saved
    tensors and options to the backward kernel; lse is not differentiable and its gradient is
    not materialized; only the inputs that require grad get one."""
    q, k, v = _qkv(grad=True)
    dout = torch.randn(q.shape)
    out, lse = torch.ops.flash3.fwd(q, k, v, 0.25, True, True)
    out.backward(dout.expand(out.shape))
    (name, c), = calls[1:]
    assert name == "bwd" and (c["softmax_scale"], c["causal"], c["deterministic"]) == (0.25, True, True)
    ref = stand_in.attention_grads(dout, q, k, v, 0.25, True)
    for got, r in zip((q.grad, k.grad, v.grad), ref):
        assert torch.allclose(got.double(), r, atol=1e-5)
    q2 = q.detach().requires_grad_()
    out, lse = torch.ops.flash3.fwd(q2, k.detach(), v.detach())
    (dq,) = torch.autograd.grad(out, (q2,), dout)
    assert dq.shape == q.shape
    # only lse used: no gradient at all reaches the kernels (dout arrives as None)
    n = len(calls)
    q3 = q.detach().requires_grad_()
    out, lse = torch.ops.flash3.fwd(q3, k.detach(), v.detach())
    assert not lse.requires_grad and len(calls) == n + 1


def test_cpu_operator_autograd_carries_window_and_softcap(calls):
    """The backward of torch.ops.flash3.fwd gets the forward's window and softcap (and the
    gradients are those of the windowed, capped attention)."""
    q, k, v = _qkv(sq=20, sk=26, grad=True)
    dout = torch.randn(q.shape)
    out, _ = torch.ops.flash3.fwd(q, k, v, 0.25, False, True, 4, 2, 3.0)
    out.backward(dout)
    (_, f), (name, c) = calls
    assert name == "bwd"
    for d in (f, c):
        assert (d["softmax_scale"], d["causal"], d["window_left"], d["window_right"], d["softcap"]) == (
            0.25, False, 4, 2, 3.0)
    assert c["deterministic"] is True
    ref = stand_in.attention_grads(dout, q, k, v, 0.25, False, (4, 2), 3.0)
    for got, r in zip((q.grad, k.grad, v.grad), ref):
        assert torch.allclose(got.double(), r, atol=1e-5)


def test_cpu_second_derivative_raises(calls):
    """First-order gradients may be built with create_graph=True; asking for a second derivative
    raises (flash3 has no double backward) instead of returning a wrong one."""
    q, k, v = _qkv(grad=True)
    out = flash3.flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    ref = stand_in.attention_grads(torch.ones(out.shape), q, k, v)[0]
    assert torch.allclose(dq.double(), ref, atol=1e-5)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dq.sum(), (q,))


# ---- opcheck -----------------------------------------------------------------------------------

OPCHECK_CASES = [
    dict(),
    dict(softmax_scale=0.3, causal=True),
    dict(causal=True, deterministic=True),
    dict(window_left=3, window_right=2, softcap=5.0),
    dict(causal=True, window_left=7, softcap=1.0, deterministic=True),
]
OPCHECK_IDS = ["plain", "scale_causal", "deterministic", "window_softcap", "causal_window_softcap"]


def _mask_of(kwargs):
    """(window, softcap) of an OPCHECK_CASES entry, for check and check_grads."""
    return dict(window=(kwargs.get("window_left", -1), kwargs.get("window_right", -1)),
                softcap=kwargs.get("softcap", 0.0))


@pytest.mark.parametrize("kwargs", OPCHECK_CASES, ids=OPCHECK_IDS)
@pytest.mark.parametrize("shape", [(2, 9, 12, 4, 2, 16), (1, 30, 12, 8, 1, 16)], ids=["gqa", "mqa_rows_without_keys"])
def test_cpu_opcheck_with_stand_in(calls, shape, kwargs):
    """torch.library.opcheck (schema, autograd registration, fake vs real outputs, AOT dispatch
    with dynamic shapes) with the CPU stand-ins as the kernels."""
    q, k, v = _qkv(*shape, grad=True)
    torch.library.opcheck(torch.ops.flash3.fwd.default, (q, k, v), kwargs)
    out, lse = torch.ops.flash3.fwd(q.detach(), k.detach(), v.detach(), **kwargs)
    dout = torch.randn(out.shape).transpose(1, 2).contiguous().transpose(1, 2)  # strided dout
    torch.library.opcheck(torch.ops.flash3.bwd.default, (dout, q.detach(), k.detach(), v.detach(), out, lse),
                          kwargs)


def _opcheck_cuda_cases():
    """The first three OPCHECK_CASES in both dtypes, and a causal window with softcap in bfloat16
    (opcheck compiles: a few seconds a case), at each shape."""
    shapes = {"gqa_h128": (2, 64, 80, 4, 2, 128), "mha_h64": (1, 17, 300, 4, 4, 64),
              "mqa_h256_sq_gt_sk": (1, 130, 50, 8, 1, 256)}
    cases = []
    for dtype, did in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for sid, shape in shapes.items():
            for kwargs, kid in zip(OPCHECK_CASES, OPCHECK_IDS):
                if "window_left" not in kwargs or (dtype is torch.bfloat16 and kid == "causal_window_softcap"):
                    cases.append(pytest.param(dtype, shape, kwargs, id=f"{did}-{sid}-{kid}"))
    return cases


@gpu
@pytest.mark.parametrize("dtype, shape, kwargs", _opcheck_cuda_cases())
def test_opcheck_cuda(dtype, shape, kwargs):
    """opcheck with the real kernels. The gradient comparisons of opcheck (eager against AOT
    dispatch) need run-to-run identical gradients: deterministic=True where gradients flow."""
    b, sq, sk, h, hk, d = shape
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype, "cuda", seed=sum(shape), grad=True)
    torch.library.opcheck(torch.ops.flash3.fwd.default, (q, k, v), dict(kwargs, deterministic=True))
    with torch.no_grad():
        q2, k2, v2 = (t.detach() for t in (q, k, v))
        torch.library.opcheck(torch.ops.flash3.fwd.default, (q2, k2, v2), kwargs)
        qt = q2.transpose(1, 2).contiguous().transpose(1, 2)  # a (b, h, s, d) layout: out is still contiguous
        torch.library.opcheck(torch.ops.flash3.fwd.default, (qt, k2, v2), kwargs)
        out, lse = torch.ops.flash3.fwd(q2, k2, v2, **kwargs)
        check(q2, k2, v2, kwargs.get("causal", False), kwargs.get("softmax_scale"), out, lse, **_mask_of(kwargs))
        dout = randn(tuple(q.shape), dtype, torch.Generator(device="cuda").manual_seed(1))
        torch.library.opcheck(torch.ops.flash3.bwd.default, (dout, q2, k2, v2, out, lse), kwargs)
        dq, dk, dv = torch.ops.flash3.bwd(dout, q2, k2, v2, out, lse, **kwargs)
    check_grads(q2, k2, v2, dout, kwargs.get("causal", False), (dq, dk, dv), scale=kwargs.get("softmax_scale"),
                **_mask_of(kwargs))


@gpu
@pytest.mark.parametrize("mask", [dict(), dict(window_size=(100, 0), softcap=20.0)], ids=["causal", "window_softcap"])
def test_operators_match_eager_bitwise(mask):
    """torch.ops.flash3.fwd / bwd and the eager flash_attn_func path run the same kernels: the
    same bits (deterministic backward), with a window and softcap too."""
    q, k, v = _qkv(2, 200, 300, 8, 2, 128, torch.bfloat16, "cuda", seed=4, grad=True)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    out = flash3.flash_attn_func(q, k, v, causal=True, deterministic=True, **mask)
    eager = [out] + list(torch.autograd.grad(out, (q, k, v), dout))
    left, softcap = mask.get("window_size", (-1, 0))[0], mask.get("softcap", 0.0)
    out2, _ = torch.ops.flash3.fwd(q, k, v, None, True, True, left, -1, softcap)
    ops = [out2] + list(torch.autograd.grad(out2, (q, k, v), dout))
    for name, a, b_ in zip(("out", "dq", "dk", "dv"), eager, ops):
        assert torch.equal(a, b_), name
