"""flash3 as a drop-in for FlashAttention-3's flash_attn_interface: the signatures (checked
against a literal copy of FlashAttention-3's parameter lists), NotImplementedError for what
flash3 does not support, the ignored speed hints, flash_attn_qkvpacked_func, window_size and
softcap with FlashAttention-3's meaning (forward and backward), and a module written against
FlashAttention-3's names run unchanged with flash3 in its place. (flash_attn_varlen_func beyond
its signature: tests/test_varlen.py.)

Tests parametrized over [cpu] run without a GPU (the library calls stood in for by the math on
the CPU: tests/stand_in.py) and over [cuda] on a Hopper GPU with libflash3.so (skipped
elsewhere); test_cpu_* run anywhere. Run: PYTHONPATH=python python3 -m pytest -q tests/test_interface.py
"""
import importlib.util
import inspect
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402
import flash3.flash_attn_interface as flash_attn_interface  # noqa: E402
import stand_in  # noqa: E402
from test_torch import check, check_grads, gpu  # noqa: E402

_ = inspect.Parameter.empty
# FlashAttention-3, hopper/flash_attn_interface.py: (name, default) in order, every parameter
# positional-or-keyword.
FA3_FLASH_ATTN_FUNC = [
    ("q", _), ("k", _), ("v", _), ("softmax_scale", None), ("causal", False), ("qv", None),
    ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
    ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
]
FA3_FLASH_ATTN_VARLEN_FUNC = [
    ("q", _), ("k", _), ("v", _), ("cu_seqlens_q", _), ("cu_seqlens_k", _), ("max_seqlen_q", _),
    ("max_seqlen_k", _), ("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False),
    ("qv", None), ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
    ("sm_margin", 0), ("return_attn_probs", False),
]
FA3_FLASH_ATTN_QKVPACKED_FUNC = [
    ("qkv", _), ("softmax_scale", None), ("causal", False), ("q_descale", None), ("k_descale", None),
    ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
    ("deterministic", False), ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False),
]


@pytest.mark.parametrize("func, fa3", [(flash3.flash_attn_func, FA3_FLASH_ATTN_FUNC),
                                       (flash3.flash_attn_qkvpacked_func, FA3_FLASH_ATTN_QKVPACKED_FUNC),
                                       (flash3.flash_attn_varlen_func, FA3_FLASH_ATTN_VARLEN_FUNC)],
                         ids=["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"])
def test_cpu_signature_is_fa3s(func, fa3):
    params = list(inspect.signature(func).parameters.values())
    assert [(p.name, p.default) for p in params] == fa3
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    for p, (_, default) in zip(params, fa3):
        assert type(p.default) is type(default)  # 0.0 stays a float, (-1, -1) a tuple


def test_cpu_module_alias():
    from flash3 import flash_attn_interface as via_from
    assert via_from is flash_attn_interface
    assert flash_attn_interface.flash_attn_func is flash3.flash_attn_func
    assert flash_attn_interface.flash_attn_qkvpacked_func is flash3.flash_attn_qkvpacked_func
    assert flash_attn_interface.flash_attn_varlen_func is flash3.flash_attn_varlen_func
    assert flash_attn_interface.flash_attn_with_kvcache is flash3.flash_attn_with_kvcache
    assert flash_attn_interface.get_scheduler_metadata is flash3.get_scheduler_metadata
    assert set(flash_attn_interface.__all__) == {"flash_attn_func", "flash_attn_qkvpacked_func",
                                                 "flash_attn_varlen_func", "flash_attn_with_kvcache",
                                                 "get_scheduler_metadata"}
    assert flash3._IGNORED == ("num_splits", "pack_gqa", "sm_margin")


UNSUPPORTED = [
    (dict(qv=torch.zeros(1, 16, 2, 64)), "qv"),
    (dict(attention_chunk=256), "attention_chunk"),
    (dict(attention_chunk=64, window_size=(128, 0), softcap=30.0), "attention_chunk"),
]


@pytest.mark.parametrize("kwargs, name", UNSUPPORTED, ids=["qv", "attention_chunk", "attention_chunk_with_window"])
def test_cpu_unsupported_argument_raises_naming_it(kwargs, name):
    """Checked before anything runs: CPU tensors, no library needed."""
    q = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"\b{name}\b"):
        flash3.flash_attn_func(q, q, q, **kwargs)
    if "qv" not in kwargs:
        with pytest.raises(NotImplementedError, match=rf"\b{name}\b"):
            flash3.flash_attn_qkvpacked_func(torch.zeros(1, 16, 3, 2, 64, dtype=torch.bfloat16), **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(window_size=(1.5, 0)), "window_size"),
    (dict(window_size=(8, "0")), "window_size"),
    (dict(window_size=(8,)), "window_size"),
    (dict(window_size=(1, 2, 3)), "window_size"),
    (dict(window_size=8), "window_size"),
    (dict(window_size=None), "window_size"),
    (dict(softcap="30"), "softcap"),
    (dict(softcap=None), "softcap"),
    (dict(softcap=torch.tensor(30.0)), "softcap"),
    (dict(softcap=1e300), "softcap"),
], ids=["window_float", "window_str", "window_one", "window_three", "window_int", "window_none", "softcap_str",
        "softcap_none", "softcap_tensor", "softcap_huge"])
def test_cpu_window_and_softcap_of_a_wrong_type_raise_value_error_naming_it(kwargs, name):
    """A window_size that is not a pair of ints, a softcap that is not a real number (or one
    float32 cannot carry): ValueError naming the argument, before anything runs (CPU tensors, no
    library needed). Values of the right type are the library's to check."""
    q = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        flash3.flash_attn_func(q, q, q, **kwargs)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        flash3.flash_attn_qkvpacked_func(torch.zeros(1, 16, 3, 2, 64, dtype=torch.bfloat16), **kwargs)


@pytest.mark.parametrize("window, causal, want", [
    ((-1, -1), False, (False, -1, -1)),
    ((-5, -9), False, (False, -1, -1)),   # a negative side is unbounded
    ((-1, 0), False, (True, -1, -1)),     # causal
    ((-1, 8), True, (True, -1, -1)),      # causal makes the right side 0
    ((128, 0), False, (True, 128, -1)),   # right 0: causal with a left bound
    ((128, 64), True, (True, 128, -1)),
    ((4, 4), False, (False, 4, 4)),
    ((-3, 7), False, (False, -1, 7)),
    ([0, 0], False, (True, 0, -1)),
    ((10**12, 5), False, (False, 2**31 - 1, 5)),  # past int32: excludes nothing, as the library's int32 max
    ((-10**12, 5), False, (False, -1, 5)),
])
def test_cpu_window_size_as_flash3_options(window, causal, want):
    """FlashAttention-3's (window_size, causal) as flash3's (causal, window_left, window_right)."""
    assert flash_attn_interface._window(window, causal) == want


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_cpu_descale_with_16bit_inputs_raises_value_error_naming_it(name):
    """FP8 descales apply to float8_e4m3fn inputs only: with 16-bit ones, a ValueError naming the
    argument, before anything runs (CPU tensors, no library needed)."""
    q = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"^{name}\b.*torch.bfloat16"):
        flash3.flash_attn_func(q, q, q, **{name: torch.ones(1, 2)})
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        flash3.flash_attn_qkvpacked_func(torch.zeros(1, 16, 3, 2, 64, dtype=torch.bfloat16), **{name: torch.ones(1, 2)})


def test_cpu_unknown_argument_is_a_type_error():
    q = torch.zeros(1, 16, 2, 64)
    with pytest.raises(TypeError, match="no_such_option"):
        flash3.flash_attn_func(q, q, q, no_such_option=1)
    with pytest.raises(TypeError, match="dropout_p"):  # FlashAttention-2's, not FlashAttention-3's
        flash3.flash_attn_func(q, q, q, dropout_p=0.0)


@pytest.mark.parametrize("shape, kwargs, name", [
    ((1, 16, 4, 2, 64), {}, "qkv"),
    ((1, 16, 8, 64), {}, "num_heads_q"),
    ((1, 16, 8, 64), dict(num_heads_q=5), "num_heads_q"),
    ((1, 16, 8, 64), dict(num_heads_q=8), "num_heads_q"),
    ((16, 8, 64), {}, "qkv"),
], ids=["five_dims_not_3", "four_dims_no_num_heads_q", "bad_split", "no_kv_heads", "three_dims"])
def test_cpu_qkvpacked_bad_layout_names_the_argument(shape, kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        flash3.flash_attn_qkvpacked_func(torch.zeros(shape), **kwargs)


# ---- cpu (stand-ins) and cuda (the kernels) -----------------------------------------------------

@pytest.fixture(params=["cpu", pytest.param("cuda", marks=gpu)])
def device(request, monkeypatch):
    if request.param == "cpu":
        stand_in.install(monkeypatch)
    return request.param


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def _randn(shape, device, gen):
    return torch.randn(shape, generator=gen, device=device).to(_dtype(device))


def assert_attention(q, k, v, causal, out, lse=None, scale=None, window=(-1, -1), softcap=0.0):
    if q.is_cuda:
        if lse is None:
            lse = flash3.flash_attn_func(q, k, v, scale, causal, window_size=window, softcap=softcap,
                                         return_attn_probs=True)[1]
        check(q, k, v, causal, scale, out, lse, window=window, softcap=softcap)
        return
    ref, ref_lse = stand_in.attention(q, k, v, scale, causal, window, softcap)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if lse is not None:
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def assert_grads(q, k, v, dout, causal, got, scale=None, window=(-1, -1), softcap=0.0):
    if q.is_cuda:
        check_grads(q, k, v, dout, causal, got, scale=scale, window=window, softcap=softcap)
        return
    for g, r in zip(got, stand_in.attention_grads(dout, q, k, v, scale, causal, window, softcap)):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


def test_return_forms_options_and_ignored_hints(device):
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = _randn((2, 64, 4, 64), device, gen), _randn((2, 80, 2, 64), device, gen), _randn((2, 80, 2, 64), device, gen)
    out = flash3.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert_attention(q, k, v, False, out)
    pair = flash3.flash_attn_func(q, k, v, 0.2, True, return_attn_probs=True)
    assert isinstance(pair, tuple) and len(pair) == 2
    assert_attention(q, k, v, True, *pair, scale=0.2)
    causal = flash3.flash_attn_func(q, k, v, causal=True)
    for window, c in [((-1, 0), False), ([-1, 0], False), ((-1, -1), True), ((-3, -7), True), ((-1, 8), True)]:
        assert torch.equal(flash3.flash_attn_func(q, k, v, causal=c, window_size=window), causal), window
    assert torch.equal(flash3.flash_attn_func(q, k, v, window_size=(-2, -1)), out)
    # speed hints: accepted, and the results are the same bits
    for hints in [dict(num_splits=0), dict(num_splits=4), dict(pack_gqa=True), dict(pack_gqa=False),
                  dict(sm_margin=8), dict(num_splits=3, pack_gqa=True, sm_margin=4)]:
        assert torch.equal(flash3.flash_attn_func(q, k, v, **hints), out), hints


@pytest.mark.parametrize("window, causal, softcap", [
    ((3, 2), False, 0.0), ((40, 0), False, 5.0), ((40, 9), True, 0.0), ((-1, 11), False, 30.0), ((0, -1), True, 1.0),
    ((500, 500), False, 5.0),
], ids=["w3_2", "w40_0_softcap5", "w40_9_causal", "right_only_softcap30", "w0_causal_softcap1", "wider_than_seq"])
def test_window_and_softcap_forward_and_backward(device, window, causal, softcap):
    """window_size and softcap with FlashAttention-3's meaning, forward and backward, through
    flash_attn_func and flash_attn_qkvpacked_func (GQA, seqlen_q != seqlen_k); FlashAttention-3's
    equivalent spellings give the same bits."""
    gen = torch.Generator(device=device).manual_seed(4)
    q = _randn((2, 70, 4, 64), device, gen).requires_grad_()
    k, v = (_randn((2, 90, 2, 64), device, gen).requires_grad_() for _ in range(2))
    out, lse = flash3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                      return_attn_probs=True)
    assert not lse.requires_grad
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    assert_attention(qd, kd, vd, causal, out.detach(), lse, window=window, softcap=softcap)
    dout = _randn(tuple(out.shape), device, gen)
    out.backward(dout)
    assert_grads(qd, kd, vd, dout, causal, (q.grad, k.grad, v.grad), window=window, softcap=softcap)
    with torch.no_grad():
        left, right = window
        same = [dict(window_size=list(window), causal=causal),  # a list, as well as a tuple
                dict(window_size=(left if left >= 0 else -7, right if right >= 0 else -3), causal=causal),  # any < 0
                dict(window_size=window, causal=causal, softcap=int(softcap))]  # an int (the cases' are whole)
        if causal:  # causal is a right side of 0, and the other way round
            same.append(dict(window_size=(left, 0), causal=False))
        if right == 0:
            same.append(dict(window_size=(left, 5), causal=True))
        for kwargs in same:
            kwargs.setdefault("softcap", softcap)
            assert torch.equal(flash3.flash_attn_func(qd, kd, vd, **kwargs), out.detach()), kwargs
        if window == (500, 500):  # wider than both sequences: no window
            assert torch.equal(flash3.flash_attn_func(qd, kd, vd, causal=causal, softcap=softcap), out.detach())
    # packed qkv (MHA): the same window and softcap, forward and backward
    qkv = _randn((2, 70, 3, 2, 64), device, gen).requires_grad_()
    out = flash3.flash_attn_qkvpacked_func(qkv, None, causal, window_size=window, softcap=softcap)
    assert_attention(*qkv.detach().unbind(2), causal, out.detach(), window=window, softcap=softcap)
    out.backward(dout[:, :, :2])
    assert_grads(*qkv.detach().unbind(2), dout[:, :, :2], causal, qkv.grad.unbind(2), window=window, softcap=softcap)


def test_cpu_window_and_softcap_reach_the_kernels(calls):
    """flash_attn_func hands the library flash3's spelling of the window (causal for a right side
    of 0) and the softcap, forward and backward (stand-ins record the calls)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=gen).requires_grad_() for _ in range(3))
    flash3.flash_attn_func(q, k, v, 0.5, window_size=(7, 0), softcap=12, deterministic=True).sum().backward()
    flash3.flash_attn_func(q, k, v, window_size=(-1, 4), softcap=2.5).sum().backward()
    got = [(name, c["softmax_scale"], c["causal"], c["window_left"], c["window_right"], c["softcap"])
           for name, c in calls]
    assert got == [("fwd", 0.5, True, 7, -1, 12.0), ("bwd", 0.5, True, 7, -1, 12.0),
                   ("fwd", None, False, -1, 4, 2.5), ("bwd", None, False, -1, 4, 2.5)]
    assert all(type(c["softcap"]) is float for _, c in calls)


@pytest.mark.parametrize("layout", ["five_dims", "four_dims_gqa"])
def test_qkvpacked(device, layout):
    """flash_attn_qkvpacked_func matches flash_attn_func on the parts, forward and backward; the
    gradient is one tensor shaped like qkv."""
    gen = torch.Generator(device=device).manual_seed(2)
    b, s, d = 2, 130, 128
    if layout == "five_dims":
        qkv = _randn((b, s, 3, 4, d), device, gen)
        kwargs, parts = {}, lambda t: t.unbind(2)
    else:
        qkv = _randn((b, s, 6 + 2 * 2, d), device, gen)  # 6 query heads, 2 kv heads
        kwargs, parts = dict(num_heads_q=6), lambda t: t.split([6, 2, 2], dim=2)
    q, k, v = parts(qkv)
    for causal in (False, True):
        out, lse = flash3.flash_attn_qkvpacked_func(qkv, None, causal, return_attn_probs=True, **kwargs)
        assert_attention(q, k, v, causal, out, lse)
        assert torch.equal(out, flash3.flash_attn_func(q, k, v, causal=causal))
        x = qkv.clone().requires_grad_()
        out = flash3.flash_attn_qkvpacked_func(x, causal=causal, deterministic=True, **kwargs)
        dout = _randn(tuple(out.shape), device, gen)
        out.backward(dout)
        assert x.grad.shape == qkv.shape and x.grad.is_contiguous()
        assert_grads(q, k, v, dout, causal, parts(x.grad))
        # and under torch.ops (what torch.compile traces): the same bits
        ops_out, _ = torch.ops.flash3.fwd(q, k, v, None, causal, True)
        assert torch.equal(ops_out, out.detach())


USER_MODULE = '''
"""A model written for FlashAttention-3 (hopper/flash_attn_interface.py)."""
import torch
import flash_attn_interface
from flash_attn_interface import flash_attn_func, flash_attn_qkvpacked_func


class SelfAttention(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k, v = self.wkv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        out = flash_attn_func(q, k, v, causal=True)
        return self.wo(out.reshape(b, s, -1))


def attend_positional(q, k, v):
    return flash_attn_func(q, k, v, None, True)


def attend_every_argument(q, k, v):
    return flash_attn_interface.flash_attn_func(
        q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=False, qv=None, q_descale=None, k_descale=None,
        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
        deterministic=False, sm_margin=0, return_attn_probs=True)


def attend_packed(qkv):
    return flash_attn_qkvpacked_func(qkv, None, True, None, None, None, (-1, -1), 0, 0.0, False, None, 0, False)


def attend_local_capped(q, k, v):
    return flash_attn_func(q, k, v, None, False, None, None, None, None, (32, 8), 0, 30.0)


def attend_varlen_every_argument(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return flash_attn_interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
        softmax_scale=None, causal=True, qv=None, q_descale=None, k_descale=None, v_descale=None,
        window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
        sm_margin=0, return_attn_probs=True)
'''


def test_drop_in_module_runs_unchanged(device, monkeypatch, tmp_path):
    """The module above, written against FlashAttention-3's names, imports flash_attn_interface;
    with flash3's put in its place (the only change) it runs, forward and backward."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface", flash_attn_interface)
    path = tmp_path / "user_model.py"
    path.write_text(USER_MODULE)
    spec = importlib.util.spec_from_file_location("user_model", path)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    assert user.flash_attn_func is flash3.flash_attn_func
    gen = torch.Generator(device=device).manual_seed(3)
    q, k, v = _randn((2, 100, 8, 64), device, gen), _randn((2, 100, 2, 64), device, gen), _randn((2, 100, 2, 64), device, gen)
    assert_attention(q, k, v, True, user.attend_positional(q, k, v))
    out, lse = user.attend_every_argument(q, k, v)
    assert_attention(q, k, v, False, out, lse, scale=64 ** -0.5)
    qkv = _randn((2, 100, 3, 4, 64), device, gen)
    assert_attention(*qkv.unbind(2), True, user.attend_packed(qkv))
    assert_attention(q, k, v, False, user.attend_local_capped(q, k, v), window=(32, 8), softcap=30.0)
    # the batch as a variable-length one of two sequences of 100: the batch's attention
    cu = torch.tensor([0, 100, 200], dtype=torch.int32, device=device)
    out, lse = user.attend_varlen_every_argument(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 100, 100)
    assert out.shape == (200, 8, 64) and lse.shape == (8, 200)
    assert_attention(q, k, v, True, out.view(q.shape), lse.view(8, 2, 100).transpose(0, 1))
    torch.manual_seed(0)
    model = user.SelfAttention(256, 4, 2).to(device=device, dtype=_dtype(device))
    x = _randn((2, 100, 256), device, gen).requires_grad_()
    y = model(x)
    y.float().sum().backward()
    assert y.shape == x.shape and x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
