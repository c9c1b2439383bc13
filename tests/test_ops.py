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

FWD_SCHEMA = ("flash3::fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
              "bool deterministic=False) -> (Tensor, Tensor)")
BWD_SCHEMA = ("flash3::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
              "float? softmax_scale=None, bool causal=False, bool deterministic=False) -> (Tensor, Tensor, Tensor)")


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
    assert list(flash3._ops.OPS) == ["fwd", "bwd", "fwd_fp8", "quantize_fp8"]  # FP8: tests/test_fp8.py
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
    def exprs(sizes):
        return [n.node.expr if isinstance(n, torch.SymInt) else n for n in sizes]

    b, sq, h, d = exprs(q.shape)
    assert exprs(out.shape) == [b, sq, h, d] and exprs(out.stride()) == [sq * h * d, h * d, d, 1]
    assert exprs(lse.shape) == [b, h, sq] and exprs(lse.stride()) == [h * sq, sq, 1]
    assert lse.dtype == torch.float32
    for g, t in zip((dq, dk, dv), (q, k, v)):
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
]


@pytest.mark.parametrize("kwargs", OPCHECK_CASES, ids=["plain", "scale_causal", "deterministic"])
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


@gpu
@pytest.mark.parametrize("kwargs", OPCHECK_CASES, ids=["plain", "scale_causal", "deterministic"])
@pytest.mark.parametrize("shape", [(2, 64, 80, 4, 2, 128), (1, 17, 300, 4, 4, 64), (1, 130, 50, 8, 1, 256)],
                         ids=["gqa_h128", "mha_h64", "mqa_h256_sq_gt_sk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
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
        check(q2, k2, v2, kwargs.get("causal", False), kwargs.get("softmax_scale"), out, lse)
        dout = randn(tuple(q.shape), dtype, torch.Generator(device="cuda").manual_seed(1))
        torch.library.opcheck(torch.ops.flash3.bwd.default, (dout, q2, k2, v2, out, lse), kwargs)
        dq, dk, dv = torch.ops.flash3.bwd(dout, q2, k2, v2, out, lse, **kwargs)
    check_grads(q2, k2, v2, dout, kwargs.get("causal", False), (dq, dk, dv), scale=kwargs.get("softmax_scale"))


@gpu
def test_operators_match_eager_bitwise():
    """torch.ops.flash3.fwd / bwd and the eager flash_attn_func path run the same kernels: the
    same bits (deterministic backward)."""
    q, k, v = _qkv(2, 200, 300, 8, 2, 128, torch.bfloat16, "cuda", seed=4, grad=True)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    out = flash3.flash_attn_func(q, k, v, causal=True, deterministic=True)
    eager = [out] + list(torch.autograd.grad(out, (q, k, v), dout))
    out2, _ = torch.ops.flash3.fwd(q, k, v, None, True, True)
    ops = [out2] + list(torch.autograd.grad(out2, (q, k, v), dout))
    for name, a, b_ in zip(("out", "dq", "dk", "dv"), eager, ops):
        assert torch.equal(a, b_), name
