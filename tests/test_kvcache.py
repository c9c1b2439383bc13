"""Decoding over a contiguous KV cache: flash3.flash_attn_with_kvcache (FlashAttention-3's
signature), the operator flash3::fwd_kvcache (schema, fake), forward_kvcache_into, the append of
new keys and values with rotary embedding (flash3.kvcache) against a float64 RoPE written here,
the arguments not supported yet, argument errors, torch.compile, CUDA graphs, and the kernels'
results.

Entry b of q (batch, seqlen_q, nheads, headdim) attends to k_cache[b, :cache_seqlens[b]], the
masks aligned bottom-right to that length. The reference: tests/test_torch.py's check (FP64
stand-in, tolerance 2 x the plain input-precision error + 1e-5, lse within 1e-3) on each batch
entry's slice of the cache; an entry with an empty cache gives out 0, lse +inf.
Tests named test_cpu_* run without a GPU (the library calls stood in for on the CPU by
tests/stand_in.py); tests parametrized over [cpu] and [cuda] make the same checks on both
(cuda: a Hopper GPU and libflash3.so, skipped elsewhere); the others need the GPU.
Run: PYTHONPATH=python python3 -m pytest -q tests/test_kvcache.py
"""
import inspect
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402
import stand_in  # noqa: E402
from test_torch import capture, check, gpu  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FWD_KVCACHE_SCHEMA = ("flash3::fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens=None, "
                      "float? softmax_scale=None, bool causal=False, SymInt window_left=-1, SymInt window_right=-1, "
                      "float softcap=0.) -> (Tensor, Tensor)")
_ = inspect.Parameter.empty
# FlashAttention-3, hopper/flash_attn_interface.py: (name, default) in order.
FA3_FLASH_ATTN_WITH_KVCACHE = [
    ("q", _), ("k_cache", _), ("v_cache", _), ("k", None), ("v", None), ("qv", None), ("rotary_cos", None),
    ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
    ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("max_seqlen_q", None),
    ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
    ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("attention_chunk", 0),
    ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
    ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False),
]


def problem(batch, seqlen_q, seqlen_cache, h, hk, d, dtype=torch.bfloat16, device="cpu", seed=0, lengths=None):
    """Random q, k_cache, v_cache (N(0, 1)) and cache_seqlens (the given lengths, else random
    in [0, seqlen_cache] with 0 and seqlen_cache among them)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    if lengths is None:
        r = torch.randint(0, seqlen_cache + 1, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
        lengths = ([0, seqlen_cache] + r)[:batch]
    return dict(q=randn(batch, seqlen_q, h, d), k_cache=randn(batch, seqlen_cache, hk, d),
                v_cache=randn(batch, seqlen_cache, hk, d),
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device))


def check_kvcache(p, out, lse, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """Each batch entry against the reference over its slice of the cache."""
    q, k, v = p["q"], p["k_cache"], p["v_cache"]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    for b, n in enumerate(p["cache_seqlens"].tolist()):
        if n == 0:  # no key: out 0, lse +inf
            assert (out[b] == 0).all() and torch.isposinf(lse[b]).all(), f"entry {b}: empty cache"
            continue
        check(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal, scale, out=out[b:b + 1], lse=lse[b:b + 1],
              window=window, softcap=softcap)


# ---- registration, signature, fake ---------------------------------------------------------------

def test_cpu_op_registered_and_signature_is_fa3s():
    assert str(torch.ops.flash3.fwd_kvcache.default._schema) == FWD_KVCACHE_SCHEMA
    op = torch.ops.flash3.fwd_kvcache.default
    assert torch.Tag.pt2_compliant_tag in op.tags and not op._schema.is_mutable
    assert {"flash_attn_with_kvcache", "forward_kvcache_into"} <= set(flash3.__all__)
    assert flash3.flash_attn_interface.flash_attn_with_kvcache is flash3.flash_attn_with_kvcache
    params = list(inspect.signature(flash3.flash_attn_with_kvcache).parameters.values())
    assert [(x.name, x.default) for x in params] == FA3_FLASH_ATTN_WITH_KVCACHE
    assert all(x.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for x in params)


def test_cpu_fake_shapes():
    """Under FakeTensorMode: out like q, contiguous; lse float32 (batch, nheads, seqlen_q)."""
    with FakeTensorMode():
        q = torch.empty(3, 2, 32, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(3, 1000, 8, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        qt = torch.empty(3, 32, 2, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        for qq in (q, qt):
            for cache_seqlens in (lens, None):
                out, lse = torch.ops.flash3.fwd_kvcache(qq, k, k, cache_seqlens, causal=True)
                assert out.shape == qq.shape and out.dtype == qq.dtype and out.is_contiguous()
                assert lse.shape == (3, 32, 2) and lse.dtype == torch.float32


# ---- results ----------------------------------------------------------------------------------------

CASES = [  # batch, seqlen_q, seqlen_cache, h, hk, causal, window, softcap
    ("decode_gqa8", 4, 1, 300, 8, 1, True, (-1, -1), 0.0),
    ("decode_mha", 3, 1, 257, 4, 4, False, (-1, -1), 0.0),
    ("spec4_gqa4_causal", 4, 4, 300, 8, 2, True, (-1, -1), 0.0),
    ("chunk130_causal_window", 3, 130, 400, 4, 2, True, (100, -1), 0.0),
    ("spec3_softcap", 3, 3, 200, 4, 1, False, (-1, -1), 10.0),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kvcache_matches_fp64(monkeypatch, device, dtype, hdim, case):
    """cache_seqlens with 0, the whole cache and random lengths; GQA / MHA, causal, window,
    softcap; on the GPU also forward_kvcache_into into NaN-poisoned buffers (every element
    written, the same bits)."""
    if device == "cpu":
        if hdim != 64:
            pytest.skip("the CPU run checks the wiring: one head dim")
        stand_in_calls = stand_in.install(monkeypatch)
    _, b, sq, sc, h, hk, causal, window, softcap = case
    p = problem(b, sq, sc, h, hk, hdim, dtype, device, seed=hash((case[0], hdim)) % 2**31)
    out, lse = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                              causal=causal, window_size=window, softcap=softcap,
                                              return_softmax_lse=True)
    check_kvcache(p, out, lse, causal, window, softcap)
    assert torch.equal(flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"],
                                                      cache_seqlens=p["cache_seqlens"], causal=causal,
                                                      window_size=window, softcap=softcap), out)
    if device == "cpu":  # the values stay on the device: no check, as FlashAttention-3
        assert not any(c["check_seqlens"] for name, c in stand_in_calls if name == "fwd_kvcache")
    if device == "cuda":
        c, left, right = flash3.flash_attn_interface._window(window, causal)
        out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        flash3.forward_kvcache_into(p["q"], p["k_cache"], p["v_cache"], out2, lse2, p["cache_seqlens"], causal=c,
                                    window_left=left, window_right=right, softcap=softcap)
        torch.cuda.synchronize()
        assert torch.equal(out2, out) and torch.equal(lse2, lse), "forward_kvcache_into into poisoned buffers differs"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_int_and_missing_cache_seqlens(monkeypatch, device):
    """An int is every entry's length (FlashAttention-3's torch.full); None is the whole cache,
    the same as flash_attn_func over it."""
    if device == "cpu":
        stand_in.install(monkeypatch)
    p = problem(3, 2, 150, 4, 2, 64, device=device, seed=5, lengths=[77, 77, 77])
    q, k, v = p["q"], p["k_cache"], p["v_cache"]
    by_tensor = flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=p["cache_seqlens"], causal=True)
    assert torch.equal(flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=77, causal=True), by_tensor)
    whole, lse = flash3.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True)
    ref, ref_lse = flash3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.testing.assert_close(whole, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_cpu_compile_fullgraph(calls):
    """torch.compile(fullgraph=True, dynamic=True) through flash3::fwd_kvcache, with an int and a
    tensor cache_seqlens, and the reference's results."""
    def f(q, k, v, lens):
        return flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for seed, sc in ((1, 120), (2, 90)):
        p = problem(2, 3, sc, 4, 2, 64, seed=seed)
        out, lse = compiled(p["q"], p["k_cache"], p["v_cache"], p["cache_seqlens"])
        check_kvcache(p, out, lse, causal=True)
    assert [name for name, _ in calls] == ["fwd_kvcache"] * 2
    out = torch.compile(lambda q, k, v: flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=40), fullgraph=True,
                        backend="aot_eager")(p["q"], p["k_cache"], p["v_cache"])
    assert calls[-1][1]["cache_seqlens"].tolist() == [40, 40] and out.shape == p["q"].shape


# ---- append with rotary ------------------------------------------------------------------------------

def rope_reference(x, cos, sin, positions, interleaved):
    """RoPE in float64, element by element: for each pair (a, b) of the first 2 x cos.shape[1]
    dims (interleaved: dims 2i, 2i + 1; else i, i + rotary_dim / 2) at position p,
    (a cos(p, i) - b sin(p, i), a sin(p, i) + b cos(p, i))."""
    out = x.double().clone()
    half = cos.shape[1]
    for bi in range(x.shape[0]):
        for si in range(x.shape[1]):
            p = int(positions[bi][si])
            for i in range(half):
                ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                c, s = float(cos[p, i]), float(sin[p, i])
                a, b = x[bi, si, :, ia].double(), x[bi, si, :, ib].double()
                out[bi, si, :, ia], out[bi, si, :, ib] = a * c - b * s, a * s + b * c
    return out


def rotary_tables(seqlen_ro, rotary_dim, device, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


APPEND_CASES = [  # seqlen_q, seqlen_new, causal, window, rotary_dim (0: none), interleaved
    ("decode_rotary_neox", 1, 1, True, (-1, -1), 64, False),
    ("spec3_rotary_interleaved", 3, 3, True, (-1, -1), 32, True),
    ("chunk40_noncausal_rotary", 40, 40, False, (-1, -1), 64, False),
    ("window_rotary_interleaved", 5, 5, False, (8, 0), 16, True),
    ("append_without_rotary", 2, 7, True, (-1, -1), 0, False),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("case", APPEND_CASES, ids=[c[0] for c in APPEND_CASES])
def test_append_with_rotary(monkeypatch, device, case):
    """k, v appended at cache_seqlens (rows before and after untouched), the new keys and q rotated
    as FlashAttention-3 says (q at cache_seqlens + i when causal or local, else at cache_seqlens),
    against the float64 RoPE within the input dtype's rounding; out is the attention of the
    rotated q over the cache with cache_seqlens + seqlen_new keys (the reference's results)."""
    if device == "cpu":
        stand_in.install(monkeypatch)
    _, sq, s_new, causal, window, rot, interleaved = case
    b, sc, h, hk, d = 3, 96, 4, 2, 64
    p = problem(b, sq, sc, h, hk, d, device=device, seed=hash(case[0]) % 2**31, lengths=[0, 50, sc - s_new])
    g = torch.Generator(device=device).manual_seed(11)
    k_new = torch.randn(b, s_new, hk, d, generator=g, device=device).to(torch.bfloat16)
    v_new = torch.randn(b, s_new, hk, d, generator=g, device=device).to(torch.bfloat16)
    cos, sin = rotary_tables(sc + 8, rot, device) if rot else (None, None)
    k_before, v_before = p["k_cache"].clone(), p["v_cache"].clone()
    lens = p["cache_seqlens"]
    out, lse = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], k_new, v_new, rotary_cos=cos,
                                              rotary_sin=sin, cache_seqlens=lens, causal=causal, window_size=window,
                                              rotary_interleaved=interleaved, return_softmax_lse=True)
    assert lens.tolist() == [0, 50, sc - s_new], "cache_seqlens must not change (the caller advances it)"
    start = lens.long()[:, None]
    pos_k = start + torch.arange(s_new, device=device)[None, :]
    local = causal or window != (-1, -1)
    pos_q = start + torch.arange(sq, device=device)[None, :] if local else start.expand(b, sq)
    want_k = rope_reference(k_new, cos, sin, pos_k, interleaved) if rot else k_new.double()
    want_q = rope_reference(p["q"], cos, sin, pos_q, interleaved) if rot else p["q"].double()
    for e, n in enumerate(lens.tolist()):
        got_k, got_v = p["k_cache"][e, n:n + s_new], p["v_cache"][e, n:n + s_new]
        torch.testing.assert_close(got_k.double(), want_k[e], rtol=2**-7, atol=1e-6)
        assert torch.equal(got_v, v_new[e]), f"entry {e}: v not appended as given"
        for name, now, before in (("k", p["k_cache"], k_before), ("v", p["v_cache"], v_before)):
            assert torch.equal(now[e, :n], before[e, :n]) and torch.equal(now[e, n + s_new:], before[e, n + s_new:]), \
                f"entry {e}: {name}_cache rows outside the append changed"
    q_rot = want_q.to(torch.bfloat16)
    check_kvcache(dict(p, q=q_rot, cache_seqlens=lens + s_new), out, lse, causal, window)


def test_cpu_compile_fullgraph_with_append(calls):
    """The append with rotary under torch.compile(fullgraph=True): the cache updated in place and
    the same results as the eager call."""
    def f(q, kc, vc, k, v, cos, sin, lens):
        return flash3.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                              causal=True)

    p = problem(2, 2, 40, 4, 2, 64, seed=4, lengths=[5, 30])
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 2, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = rotary_tables(48, 32, "cpu")
    kc, vc = p["k_cache"].clone(), p["v_cache"].clone()
    eager = f(p["q"], kc, vc, k, v, cos, sin, p["cache_seqlens"])
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(p["q"], p["k_cache"], p["v_cache"], k, v, cos, sin,
                                                                p["cache_seqlens"])
    assert torch.equal(got, eager)
    assert torch.equal(p["k_cache"], kc) and torch.equal(p["v_cache"], vc)


@pytest.mark.parametrize("change, pattern", [
    (dict(v=None), r"^k and v: give both or neither"),
    (dict(k=torch.zeros(2, 3, 1, 32, dtype=torch.bfloat16)), r"^k: shape \(2, 3, 1, 32\), expected"),
    (dict(v=torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)), r"^v: seqlen_new 4 differs from k's 3"),
    (dict(k=torch.zeros(2, 3, 1, 64, dtype=torch.float16)), r"^k: torch.float16 on cpu, expected k_cache's"),
    (dict(rotary_sin=None), r"^rotary_cos and rotary_sin: give both or neither"),
    (dict(k=None, v=None), r"^rotary_cos: applies with k and v only"),
    (dict(rotary_cos=torch.zeros(10, 40), rotary_sin=torch.zeros(10, 40)), r"^rotary_cos: shape \(10, 40\); "),
    (dict(rotary_sin=torch.zeros(10, 8)), r"^rotary_sin: shape \(10, 8\) differs"),
    (dict(cache_seqlens=None), r"^cache_seqlens: required with k and v"),
], ids=["v_missing", "k_shape", "v_seqlen", "k_dtype", "sin_missing", "rotary_without_k", "rotary_dim", "sin_shape",
        "lens_missing"])
def test_cpu_bad_append_arguments_raise_naming_them(calls, change, pattern):
    p = problem(2, 1, 16, 2, 1, 64)
    cos, sin = rotary_tables(20, 32, "cpu")
    args = dict(q=p["q"], k_cache=p["k_cache"], v_cache=p["v_cache"], k=torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16),
                v=torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16), rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=p["cache_seqlens"])
    args.update(change)
    before = p["k_cache"].clone()
    with pytest.raises(ValueError, match=pattern):
        flash3.flash_attn_with_kvcache(**args)
    assert calls == [] and torch.equal(p["k_cache"], before)


# ---- arguments ----------------------------------------------------------------------------------------

UNSUPPORTED = ["qv", "cache_batch_idx", "cache_leftpad", "page_table",
               "cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q", "rotary_seqlens", "q_descale", "k_descale",
               "v_descale", "scheduler_metadata"]


@pytest.mark.parametrize("name", UNSUPPORTED + ["attention_chunk"])
def test_cpu_unsupported_arguments_raise_naming_them(calls, name):
    p = problem(2, 1, 16, 2, 1, 64)
    value = 128 if name == "attention_chunk" else torch.zeros(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=rf"^{name}=.* is not supported by flash3"):
        flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                       **{name: value})
    assert calls == []


def test_cpu_speed_hints_accepted_and_ignored(calls):
    p = problem(2, 1, 16, 2, 1, 64, seed=3)
    base = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"])
    hinted = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                            num_splits=4, pack_gqa=True, sm_margin=8, rotary_interleaved=False)
    assert torch.equal(base, hinted)


@pytest.mark.parametrize("change, error, pattern", [
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, r"^cache_seqlens: dtype torch.int64"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, r"^cache_seqlens: shape \(3,\), expected"),
    (dict(cache_seqlens=torch.zeros(2, 1, dtype=torch.int32)), ValueError, r"^cache_seqlens: expected shape"),
    (dict(cache_seqlens=-1), ValueError, r"^cache_seqlens: -1 is out of range"),
    (dict(cache_seqlens=1.5), ValueError, r"^cache_seqlens: expected an int"),
    (dict(k_cache=torch.zeros(2, 16, 64)), ValueError, r"^k_cache: expected \(batch, seqlen_cache"),
    (dict(q=torch.zeros(2, 2, 64)), ValueError, r"^q: expected \(batch, seqlen_q"),
    (dict(window_size=(1, 2, 3)), ValueError, r"^window_size"),
], ids=["lens_dtype", "lens_length", "lens_rank", "lens_negative_int", "lens_float", "k_rank", "q_rank", "window"])
def test_cpu_bad_arguments_raise_naming_them(calls, change, error, pattern):
    p = problem(2, 1, 16, 2, 1, 64)
    args = dict(q=p["q"], k_cache=p["k_cache"], v_cache=p["v_cache"], cache_seqlens=p["cache_seqlens"])
    args.update(change)
    with pytest.raises(error, match=pattern):
        flash3.flash_attn_with_kvcache(**args)
    assert calls == []


def test_cpu_library_names_are_the_callers():
    """The library's messages name its seqused_k, k and v; the caller reads cache_seqlens,
    k_cache and v_cache."""
    names = flash3._kernels._cache_names
    assert names("flash3::fwd: seqused_k[1] is 9 but k.shape[1] (seqlen_k) is 8; seqused must be at most "
                 "the sequence's length") == ("flash3::fwd: cache_seqlens[1] is 9 but k_cache.shape[1] (seqlen_k) "
                                              "is 8; seqused must be at most the sequence's length")
    assert names("flash3::fwd: v: shape (2, 8, 1, 64) does not match k (2, 9, 1, 64)") == (
        "flash3::fwd: v_cache: shape (2, 8, 1, 64) does not match k_cache (2, 9, 1, 64)")
    assert names("q, k, v must be bfloat16") == "q, k_cache, v_cache must be bfloat16"


# ---- GPU only ---------------------------------------------------------------------------------------

@gpu
def test_cache_seqlens_past_the_cache():
    """A length above seqlen_cache: unchecked (the default), it counts as seqlen_cache; with
    check_seqlens=True the library's check raises naming cache_seqlens (also after an in-place
    change of a tensor that had passed)."""
    p = problem(3, 1, 64, 4, 1, 128, device="cuda", lengths=[10, 65, 3])
    q, k, v = p["q"], p["k_cache"], p["v_cache"]
    clamped = torch.tensor([10, 64, 3], dtype=torch.int32, device="cuda")
    assert torch.equal(flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=p["cache_seqlens"]),
                       flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=clamped))
    out, lse = torch.empty_like(q), torch.empty(3, 4, 1, device="cuda")
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] is 65"):
        flash3.forward_kvcache_into(q, k, v, out, lse, p["cache_seqlens"], check_seqlens=True)
    flash3.forward_kvcache_into(q, k, v, out, lse, clamped, check_seqlens=True)
    clamped[2] = 70
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] is 70"):
        flash3.forward_kvcache_into(q, k, v, out, lse, clamped, check_seqlens=True)


@gpu
def test_cuda_graph_decode_step_replayed_with_new_lengths():
    """A decode step captured into a CUDA graph and replayed after cache_seqlens changed in place:
    each replay attends to the new lengths (the reference's results)."""
    p = problem(4, 1, 512, 16, 2, 128, device="cuda", seed=7, lengths=[1, 100, 511, 256])
    q, k, v, lens = p["q"], p["k_cache"], p["v_cache"], p["cache_seqlens"]

    def step():
        return flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True)

    graph, _, (out, lse) = capture(step)
    for new in ([2, 101, 512, 0], [300, 7, 64, 129]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_kvcache(dict(p, cache_seqlens=lens), out, lse, causal=True)
