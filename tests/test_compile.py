"""torch.compile of a transformer block that calls flash3 attention: fullgraph (no graph break),
static and dynamic shapes, and mode="reduce-overhead" (CUDA graphs).

Tolerance (tests/test_torch.py's rule): max |got - fp64| <= 2 * max |plain - fp64| + atol, with
fp64 the same block in float64 (attention by the math), plain the same block eager in the input
dtype with the math attention, atol 1e-5 for outputs and 1e-4 for gradients.
Tests named test_cpu_* run without a GPU: the library calls are stood in for by the math on the
CPU (tests/stand_in.py), which checks the tracing, the fakes, the autograd partition and dynamic
shapes, not the kernels. The others need a Hopper GPU and libflash3.so.
Run: PYTHONPATH=python python3 -m pytest -q tests/test_compile.py
"""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402
import stand_in  # noqa: E402
from test_torch import attention, gpu  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention (GQA, or packed qkv) and an MLP.
    attn: "flash3" (flash_attn_func / flash_attn_qkvpacked_func) or "math" (the references)."""

    def __init__(self, dim, heads, kv_heads, packed=False, attn="flash3"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.packed, self.attn = heads, kv_heads, dim // heads, packed, attn
        self.norm1 = torch.nn.LayerNorm(dim)
        if packed:
            assert heads == kv_heads
            self.wqkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        else:
            self.wq = torch.nn.Linear(dim, dim, bias=False)
            self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        h, hk, d = self.heads, self.kv_heads, self.head_dim
        y = self.norm1(x)
        if self.packed:
            qkv = self.wqkv(y).view(b, s, 3, h, d)
            if self.attn == "flash3":
                a = flash3.flash_attn_qkvpacked_func(qkv, causal=True)
            else:
                q, k, v = qkv.unbind(2)
        else:
            q = self.wq(y).view(b, s, h, d)
            k, v = self.wkv(y).view(b, s, 2, hk, d).unbind(2)
            if self.attn == "flash3":
                a = flash3.flash_attn_func(q, k, v, causal=True)
        if self.attn != "flash3":
            a = attention(q, k, v, 1.0 / math.sqrt(d), True, upcast=False)[0]
        x = x + self.wo(a.reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


def make_block(dim, heads, kv_heads, packed, dtype, device, seed=0):
    torch.manual_seed(seed)
    return Block(dim, heads, kv_heads, packed).to(device=device, dtype=dtype)


def twin(model, dtype=None, attn="math"):
    """A copy of model with the math attention (in dtype, default model's)."""
    other = Block(model.heads * model.head_dim, model.heads, model.kv_heads, model.packed, attn)
    other.load_state_dict(model.state_dict())
    p = next(model.parameters())
    return other.to(device=p.device, dtype=dtype or p.dtype)


def run(model, x, dout):
    """(output, [dx] + [d param for each parameter]), all detached."""
    x = x.detach().clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.backward(dout.to(y.dtype))
    return y.detach().clone(), [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def assert_rule(got, plain, ref, atol, what):
    err = (got.double() - ref).abs().max().item()
    plain_err = (plain.double() - ref).abs().max().item()
    assert err <= 2 * plain_err + atol, f"{what}: max abs err {err:.3e} > 2 * plain {plain_err:.3e} + {atol}"


def check_block(model, x, dout, got):
    """got = run(...) of a flash3 block, against fp64 and plain under the tolerance rule."""
    ref = run(twin(model, torch.float64), x.double(), dout.double())
    plain = run(twin(model), x, dout)
    assert_rule(got[0], plain[0], ref[0], 1e-5, "output")
    names = ["dx"] + [n for n, _ in model.named_parameters()]
    for name, g, p, r in zip(names, got[1], plain[1], ref[1]):
        assert torch.isfinite(g).all(), f"non-finite d{name}"
        assert_rule(g, p, r, 1e-4, f"d {name}")


# ---- without a GPU: the stand-ins -----------------------------------------------------------

def _graph_capturing_backend(graphs):
    def compiler(name):
        def fn(gm, example_inputs):
            graphs.append((name, gm))
            return make_boxed_func(gm.forward)
        return fn
    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def _targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("packed", [False, True], ids=["func", "qkvpacked"])
def test_cpu_fullgraph_forward_and_backward_graphs(calls, packed):
    """One graph, no break: flash3::fwd in the forward graph, flash3::bwd in the backward one."""
    model = make_block(64, 4, 4 if packed else 2, packed, torch.float32, "cpu")
    graphs = []
    compiled = torch.compile(model, fullgraph=True, backend=_graph_capturing_backend(graphs))
    x, dout = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    got = run(compiled, x, dout)
    assert [name for name, _ in graphs] == ["forward", "backward"]
    assert torch.ops.flash3.fwd.default in _targets(graphs[0][1])
    assert torch.ops.flash3.bwd.default in _targets(graphs[1][1])
    assert torch.ops.flash3.fwd.default not in _targets(graphs[1][1])  # no recomputation
    eager = run(model, x, dout)
    for g, e in zip([got[0]] + got[1], [eager[0]] + eager[1]):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def check_compiled_cpu(model, compiled, dynamic, shapes, tol):
    """Runs `compiled` on (batch, seqlen) shapes in turn (with dynamic=True the later ones must
    not recompile) and compares output and gradients with the eager model."""
    for i, (b, s) in enumerate(shapes):
        x, dout = torch.randn(b, s, 64), torch.randn(b, s, 64)
        if dynamic and i:
            with torch.compiler.set_stance("fail_on_recompile"):
                got = run(compiled, x, dout)
        else:
            got = run(compiled, x, dout)
        eager = run(model, x, dout)
        for g, e in zip([got[0]] + got[1], [eager[0]] + eager[1]):
            torch.testing.assert_close(g, e, rtol=tol, atol=tol)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("packed", [False, True], ids=["func", "qkvpacked"])
def test_cpu_compile_aot_eager(calls, packed, dynamic):
    """torch.compile(fullgraph=True) through AOTAutograd (no code generation), static and
    dynamic shapes: dynamic=True compiles once for two batch sizes and sequence lengths."""
    model = make_block(64, 4, 4 if packed else 1, packed, torch.float32, "cpu")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    check_compiled_cpu(model, compiled, dynamic, [(2, 16), (3, 24)], tol=1e-5)


def _inductor_cpu_works():
    try:
        torch.compile(lambda t: t * 2 + 1, backend="inductor", fullgraph=True)(torch.ones(4))
        return True
    except Exception:  # no C++ toolchain for inductor's CPU code: the aot_eager tests still run
        return False


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_cpu_compile_inductor(calls, dynamic):
    if not _inductor_cpu_works():
        pytest.skip("inductor cannot build CPU kernels here")
    model = make_block(64, 4, 2, False, torch.float32, "cpu")
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    check_compiled_cpu(model, compiled, dynamic, [(2, 16), (3, 40)], tol=1e-4)


def test_cpu_compile_passes_the_options(calls):
    """softmax_scale, causal (also spelled window_size=(-1, 0)), deterministic and
    return_attn_probs reach the operators under compile as in eager."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 12, 4, 16, generator=gen).requires_grad_() for _ in range(3))

    def f(q, k, v):
        out, lse = flash3.flash_attn_func(q, k, v, 0.3, window_size=(-1, 0), deterministic=True,
                                          return_attn_probs=True)
        return out * 2, lse

    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.sum().backward()
    fwd, bwd = [c for _, c in calls if "out" in c and "dout" not in c], [c for _, c in calls if "dout" in c]
    assert fwd[-1]["softmax_scale"] == 0.3 and fwd[-1]["causal"] is True
    assert (bwd[-1]["softmax_scale"], bwd[-1]["causal"], bwd[-1]["deterministic"]) == (0.3, True, True)
    ref, ref_lse = stand_in.attention(q, k, v, 0.3, True)
    torch.testing.assert_close(out.double(), 2 * ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert not lse.requires_grad


def test_cpu_compile_passes_window_and_softcap(calls):
    """window_size and softcap reach flash3::fwd and flash3::bwd in one graph each (fullgraph),
    in flash3's spelling (a right side of 0 is causal), with the results of eager."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 30, 4, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 41, 2, 16, generator=gen).requires_grad_() for _ in range(2))
    dout = torch.randn(2, 30, 4, 16, generator=gen)

    def f(q, k, v):
        out, lse = flash3.flash_attn_func(q, k, v, window_size=(9, 0), softcap=4.0, deterministic=True,
                                          return_attn_probs=True)
        return out * 2, lse

    graphs = []
    out, lse = torch.compile(f, fullgraph=True, backend=_graph_capturing_backend(graphs))(q, k, v)
    out.backward(dout)
    got = [out.detach(), lse] + [t.grad.clone() for t in (q, k, v)]
    (fwd_node,) = [n for n in graphs[0][1].graph.nodes if n.target is torch.ops.flash3.fwd.default]
    (bwd_node,) = [n for n in graphs[1][1].graph.nodes if n.target is torch.ops.flash3.bwd.default]
    assert list(fwd_node.args[3:]) == [None, True, True, 9, -1, 4.0]
    assert list(bwd_node.args[6:]) == [None, True, True, 9, -1, 4.0]
    for name, c in calls:
        assert (c["causal"], c["window_left"], c["window_right"], c["softcap"]) == (True, 9, -1, 4.0), name
    assert [name for name, _ in calls] == ["fwd", "bwd"]
    for t in (q, k, v):
        t.grad = None
    o, l = f(q, k, v)
    o.backward(dout)
    want = [o.detach(), l] + [t.grad for t in (q, k, v)]
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)
    ref, ref_lse = stand_in.attention(q, k, v, None, True, (9, 0), 4.0)
    torch.testing.assert_close(out.double(), 2 * ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_cpu_compile_window_and_softcap_dynamic(calls):
    """dynamic=True with a window and softcap: one compilation serves other sequence lengths (the
    window is not specialized into shape guards), and window and softcap given as arguments of
    the compiled function reach the kernels as given."""
    def f(q, k, v, left, cap):
        return flash3.flash_attn_func(q, k, v, window_size=(left, 3), softcap=cap)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for i, (sq, sk, left, cap) in enumerate([(20, 33, 5, 2.0), (27, 40, 5, 2.0), (27, 40, 8, 6.5)]):
        gen = torch.Generator().manual_seed(i)
        q = torch.randn(1, sq, 2, 16, generator=gen)
        k, v = (torch.randn(1, sk, 1, 16, generator=gen) for _ in range(2))
        if i == 1:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = compiled(q, k, v, left, cap)
        else:
            out = compiled(q, k, v, left, cap)
        c = calls[-1][1]
        assert (c["causal"], c["window_left"], c["window_right"], c["softcap"]) == (False, left, 3, cap)
        torch.testing.assert_close(out.double(), stand_in.attention(q, k, v, None, False, (left, 3), cap)[0],
                                   rtol=1e-5, atol=1e-5)


def test_cpu_unsupported_argument_under_compile():
    """Under compile the NotImplementedError names the argument: as it is without fullgraph;
    with fullgraph=True dynamo reports it as an unsupported exception carrying the message."""
    q = torch.randn(1, 8, 2, 16)

    def f(q):
        return flash3.flash_attn_func(q, q, q, attention_chunk=128)

    with pytest.raises(NotImplementedError, match="attention_chunk"):
        torch.compile(f, backend="aot_eager")(q)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="attention_chunk"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q)


# ---- on a Hopper GPU ------------------------------------------------------------------------------

BLOCKS = [  # (dim, heads, kv_heads, packed)
    (256, 4, 2, False),  # head_dim 64, GQA
    (512, 4, 4, True),   # head_dim 128, packed qkv
]


@gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("cfg", BLOCKS, ids=["gqa_h64", "packed_h128"])
def test_compile_block(cfg, dynamic):
    """torch.compile(fullgraph=True) with inductor: output and gradients against fp64 under the
    tolerance rule; dynamic=True serves a second batch size and sequence length without
    recompiling."""
    dim, heads, kv_heads, packed = cfg
    model = make_block(dim, heads, kv_heads, packed, torch.bfloat16, "cuda")
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for i, (b, s) in enumerate([(2, 128), (3, 200)]):
        x = torch.randn(b, s, dim, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(b, s, dim, device="cuda", dtype=torch.bfloat16)
        if dynamic and i:
            with torch.compiler.set_stance("fail_on_recompile"):
                got = run(compiled, x, dout)
        else:
            got = run(compiled, x, dout)
        check_block(model, x, dout, got)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compile_window_and_softcap_matches_eager(causal):
    """torch.compile(fullgraph=True, inductor) of attention with a window and softcap: the same
    bits as the eager call, forward and (deterministic) backward, within the tolerance rule."""
    from test_torch import check, check_grads
    gen = torch.Generator(device="cuda").manual_seed(37)
    b, sq, sk, h, hk, d = 2, 300, 517, 8, 2, 128
    q = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, sk, hk, d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    window, softcap = (96, 40), 15.0

    def attn(q, k, v):
        return flash3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                      deterministic=True, return_attn_probs=True)

    def step(fn):
        for t in (q, k, v):
            t.grad = None
        out, lse = fn(q, k, v)
        out.backward(dout)
        return [out.detach().clone(), lse.clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    eager = step(attn)
    got = step(torch.compile(attn, fullgraph=True))
    torch.cuda.synchronize()
    for name, g, e in zip(("out", "lse", "dq", "dk", "dv"), got, eager):
        assert torch.equal(g, e), f"{name} of the compiled call differs from the eager call"
    check(q.detach(), k.detach(), v.detach(), causal, out=got[0], lse=got[1], window=window, softcap=softcap)
    check_grads(q, k, v, dout, causal, got[2:], window=window, softcap=softcap)


@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reduce_overhead_attention_bitwise(causal, deterministic):
    """mode="reduce-overhead": the forward replayed from a CUDA graph is bitwise the eager
    call's (the same kernels on the same bits); gradients within the tolerance rule, bitwise
    too with deterministic=True. No CUDA-graph skip. The non-causal shape takes the tail split,
    the causal one the dynamic tile scheduler (per-stream memory made at the warm-up)."""
    from test_torch import check_grads
    gen = torch.Generator(device="cuda").manual_seed(31)
    b, sq, sk, h, hk, d = (1, 1536, 1536, 8, 2, 128) if causal else (1, 2112, 3000, 8, 2, 128)
    q = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, sk, hk, d, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(torch.bfloat16)

    def attn(q, k, v):
        return flash3.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)

    def step(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        return [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    eager = step(attn)
    counters.clear()
    compiled = torch.compile(attn, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, recording, replays
        torch.compiler.cudagraph_mark_step_begin()
        got = step(compiled)
        torch.cuda.synchronize()
        assert torch.equal(got[0], eager[0]), "out from the CUDA graph differs from the eager call"
        check_grads(q, k, v, dout, causal, got[1:])
        if deterministic:
            for name, g, e in zip(("dq", "dk", "dv"), got[1:], eager[1:]):
                assert torch.equal(g, e), f"{name} from the CUDA graph differs from the eager call"
    assert counters["inductor"]["cudagraph_skips"] == 0


@gpu
@pytest.mark.parametrize("cfg", BLOCKS, ids=["gqa_h64", "packed_h128"])
def test_reduce_overhead_block(cfg):
    """A block under mode="reduce-overhead" (CUDA graphs, fullgraph): every replay gives the same
    forward bits, output and gradients (of the warm-up run and of a replay) within the tolerance
    rule, no CUDA-graph skip. (Eager against CUDA graph bitwise: the attention-only test above;
    around it inductor's fused kernels round differently from eager PyTorch.)"""
    dim, heads, kv_heads, packed = cfg
    model = make_block(dim, heads, kv_heads, packed, torch.bfloat16, "cuda")
    x = torch.randn(2, 256, dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 256, dim, device="cuda", dtype=torch.bfloat16)
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    runs = []
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        runs.append(run(compiled, x, dout))
        torch.cuda.synchronize()
    for got in runs[2:]:  # runs[0] warms up, runs[1] records the graphs, the others replay them
        assert torch.equal(got[0], runs[1][0]), "the replayed forward differs from the recorded run"
    check_block(model, x, dout, runs[0])
    check_block(model, x, dout, runs[-1])
    assert counters["inductor"]["cudagraph_skips"] == 0
