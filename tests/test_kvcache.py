"""Decoding over a KV cache: flash3.flash_attn_with_kvcache (FlashAttention-3's signature), the
operator flash3::fwd_kvcache (schema, fake), forward_kvcache_into and the C struct it packs
(flash3_kvcache_args, read back by a C function built from include/flash3/flash3_c.h), the
cache layouts (contiguous, a larger cache read through cache_batch_idx, paged through page_table
with any page size and pages in any order, cache_leftpad), num_splits, the append of new keys
and values with rotary embedding inside the kernel (k_new, v_new, rotary_cos, rotary_sin; on the
CPU the stand-in runs flash3.kvcache's torch reference) into each layout against a float64 RoPE
written here and, on the GPU, against the torch reference (the same cache: v bitwise, k within
one rounding), MLA (FlashAttention-3's qv: q and k_cache (..., 64), qv, v_cache and out (...,
512); the library's checks of its shapes, its fields in the C struct, the fake, the append with
rotary, and on the GPU the kernel against the reference of [q, qv] over [k, v] with head dim 576),
the host-side checks of the index values, the arguments not supported yet, argument errors,
opcheck, torch.compile, CUDA graphs, and the kernels' results.

Sequence b of q (batch, seqlen_q, nheads, headdim) attends to its cache positions
[cache_leftpad[b], cache_seqlens[b]), read from cache entry cache_batch_idx[b] (default b) or
through row b of page_table, the masks aligned bottom-right to those keys. The reference:
tests/test_torch.py's check (FP64 stand-in, tolerance 2 x the plain input-precision error + 1e-5,
lse within 1e-3) on each sequence's keys, gathered here position by position (sequence_keys); a
sequence without keys gives out 0, lse +inf.
Tests named test_cpu_* run without a GPU (the library calls stood in for on the CPU by
tests/stand_in.py, or, for the packing of the C struct, by a C function); tests parametrized over
[cpu] and [cuda] make the same checks on both (cuda: a Hopper GPU and libflash3.so, skipped
elsewhere); the others need the GPU.
Run: PYTHONPATH=python python3 -m pytest -q tests/test_kvcache.py
"""
import contextlib
import ctypes
import inspect
import os
import sys
import zlib

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import flash3  # noqa: E402
import c_probe  # noqa: E402
import stand_in  # noqa: E402
from test_torch import capture, check, gpu  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

FWD_KVCACHE_SCHEMA = ("flash3::fwd_kvcache(Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache, "
                      "Tensor? cache_seqlens=None, float? softmax_scale=None, bool causal=False, "
                      "SymInt window_left=-1, SymInt window_right=-1, float softcap=0., Tensor? cache_batch_idx=None, "
                      "Tensor? cache_leftpad=None, Tensor? page_table=None, SymInt num_splits=0, Tensor? k_new=None, "
                      "Tensor? v_new=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
                      "bool rotary_interleaved=True, Tensor? qv=None) -> (Tensor, Tensor)")
INDEX = ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table")  # the index tensors of a problem
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


def kv_problem(lengths, seqlen_q, h, hk, d, dtype=torch.bfloat16, device="cpu", seed=0, page_size=None,
               capacity=None, batch_idx=False, leftpad=False, dv=None):
    """A decoding problem of len(lengths) sequences (cache_seqlens = lengths): q (batch, seqlen_q,
    h, d) and the cache N(0, 1), room for `capacity` keys per sequence (default the longest
    length). The cache is contiguous (batch, capacity, hk, d); with batch_idx, a larger one of 2 x
    batch + 1 entries read through cache_batch_idx, distinct entries in random order; with
    page_size, paged: page_table (batch, ceil(capacity / page_size)) holds distinct pages of
    num_pages = batch x max_pages + 3 in random order (a few unused). leftpad: cache_leftpad[b]
    random in [0, lengths[b]] (0 for the first sequence, lengths[b] for the last: no key).
    dv (MLA): v_cache's head dim is dv (k_cache's d), and qv (batch, seqlen_q, h, dv) N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    cpu = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    capacity = max(lengths) if capacity is None else capacity

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    def int32(values):
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    p = dict(q=randn(batch, seqlen_q, h, d), cache_seqlens=int32(lengths), cache_batch_idx=None, cache_leftpad=None,
             page_table=None)
    if page_size is not None:
        max_pages = max(1, -(-capacity // page_size))
        num_pages = batch * max_pages + 3
        p["page_table"] = int32(torch.randperm(num_pages, generator=cpu)[:batch * max_pages].view(batch, max_pages))
        shape = (num_pages, page_size, hk, d)
    elif batch_idx:
        p["cache_batch_idx"] = int32(torch.randperm(2 * batch + 1, generator=cpu)[:batch])
        shape = (2 * batch + 1, capacity, hk, d)
    else:
        shape = (batch, capacity, hk, d)
    p["k_cache"], p["v_cache"] = randn(*shape), randn(*shape[:3], d if dv is None else dv)
    if dv is not None:
        p["qv"] = randn(batch, seqlen_q, h, dv)
    if leftpad:
        pad = [int(torch.randint(0, n + 1, (1,), generator=cpu)) for n in lengths]
        pad[0], pad[-1] = 0, lengths[-1]
        p["cache_leftpad"] = int32(pad)
    return p


def index_args(p):
    """The problem's index tensors as keyword arguments (None: not given)."""
    return {name: p.get(name) for name in INDEX}


def cache_slots(p, b, start, end):
    """(entries, rows), int64 tensors: where cache positions start .. end - 1 of batch entry b of
    problem p lie, looked up one by one: rows of cache entry cache_batch_idx[b] (default b), or
    row pos % page_size of page page_table[b, pos // page_size] (apart from the stand-in's and
    flash3.kvcache's index arithmetic, so that each checks the other)."""
    table, entry = p.get("page_table"), p.get("cache_batch_idx")
    if table is None:
        e = b if entry is None else int(entry[b])
        where = [(e, pos) for pos in range(start, end)]
    else:
        row, page_size = table[b].tolist(), p["k_cache"].shape[1]
        where = [(row[pos // page_size], pos % page_size) for pos in range(start, end)]
    device = p["k_cache"].device
    return (torch.tensor([w[0] for w in where], dtype=torch.long, device=device),
            torch.tensor([w[1] for w in where], dtype=torch.long, device=device))


def sequence_keys(p, b):
    """(k, v), each (1, n, nheads_kv, headdim): the keys and values of batch entry b of problem p,
    its cache positions [cache_leftpad[b], cache_seqlens[b]) (cache_slots)."""
    kc, vc, table, pad, lens = (p.get(name) for name in ("k_cache", "v_cache", "page_table", "cache_leftpad",
                                                         "cache_seqlens"))
    size = kc.shape[1] if table is None else kc.shape[1] * table.shape[1]
    end = size if lens is None else int(lens[b])
    entries, rows = cache_slots(p, b, 0 if pad is None else int(pad[b]), end)
    return kc[entries, rows][None], vc[entries, rows][None]


def check_kvcache(p, out, lse, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """Each batch entry against the reference over its keys (sequence_keys). With p["qv"] (MLA),
    the reference is the attention of [q, qv] over [k, v] (scores q k^T + qv v^T: one product of
    head dim 576, whose default scale is 1/sqrt(576)) with v as the values: out has v's head dim."""
    q, qv = p["q"], p.get("qv")
    assert out.shape == (*q.shape[:3], p["v_cache"].shape[3]) and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    for b in range(q.shape[0]):
        k, v = sequence_keys(p, b)
        if k.shape[1] == 0:  # no key: out 0, lse +inf
            assert (out[b] == 0).all() and torch.isposinf(lse[b]).all(), f"entry {b}: no key"
            continue
        qb = q[b:b + 1]
        if qv is not None:
            qb, k = torch.cat((qb, qv[b:b + 1]), dim=-1), torch.cat((k, v), dim=-1)
        check(qb, k, v, causal, scale, out=out[b:b + 1], lse=lse[b:b + 1], window=window, softcap=softcap)


# ---- registration, signature, fake ---------------------------------------------------------------

def test_cpu_op_registered_and_signature_is_fa3s():
    assert str(torch.ops.flash3.fwd_kvcache.default._schema) == FWD_KVCACHE_SCHEMA
    op = torch.ops.flash3.fwd_kvcache.default
    assert torch.Tag.pt2_compliant_tag in op.tags and op._schema.is_mutable  # the append writes the cache
    assert [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write] == [
        "k_cache", "v_cache"]
    assert {"flash_attn_with_kvcache", "forward_kvcache_into"} <= set(flash3.__all__)
    assert flash3.flash_attn_interface.flash_attn_with_kvcache is flash3.flash_attn_with_kvcache
    params = list(inspect.signature(flash3.flash_attn_with_kvcache).parameters.values())
    assert [(x.name, x.default) for x in params] == FA3_FLASH_ATTN_WITH_KVCACHE
    assert all(x.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for x in params)


def test_cpu_fake_shapes():
    """Under FakeTensorMode: out like q, contiguous; lse float32 (batch, nheads, seqlen_q), whatever
    the cache's layout (contiguous, a larger cache with cache_batch_idx, paged) and num_splits;
    the fake refuses what the kernel refuses before the library (kvcache_shapes)."""
    with FakeTensorMode():
        q = torch.empty(3, 2, 32, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(3, 1000, 8, 128, dtype=torch.bfloat16, device="cuda")
        big = torch.empty(7, 1000, 8, 128, dtype=torch.bfloat16, device="cuda")
        pages = torch.empty(40, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 10, dtype=torch.int32, device="cuda")
        qt = torch.empty(3, 32, 2, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        layouts = [(k, {}), (big, dict(cache_batch_idx=lens, cache_leftpad=lens)),
                   (pages, dict(page_table=table, num_splits=3)), (pages, dict(page_table=table, cache_leftpad=lens))]
        for qq in (q, qt):
            for cache_seqlens in (lens, None):
                for cache, kw in layouts:
                    out, lse = torch.ops.flash3.fwd_kvcache(qq, cache, cache, cache_seqlens, causal=True, **kw)
                    assert out.shape == qq.shape and out.dtype == qq.dtype and out.is_contiguous()
                    assert lse.shape == (3, 32, 2) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match=r"^cache_batch_idx: not supported with page_table"):
            torch.ops.flash3.fwd_kvcache(q, pages, pages, lens, page_table=table, cache_batch_idx=lens)
        with pytest.raises(ValueError, match=r"^num_splits: must be an int in \[0, 64\]"):
            torch.ops.flash3.fwd_kvcache(q, k, k, lens, num_splits=65)
        with pytest.raises(ValueError, match=r"^page_table: shape \(3,\), expected"):
            torch.ops.flash3.fwd_kvcache(q, pages, pages, lens, page_table=lens)


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
    """An int is every entry's length (FlashAttention-3's torch.full); None is the whole cache (the
    reference's results; on the CPU, the stand-in's flash_attn_func over it, bitwise)."""
    if device == "cpu":
        stand_in.install(monkeypatch)
    p = problem(3, 2, 150, 4, 2, 64, device=device, seed=5, lengths=[77, 77, 77])
    q, k, v = p["q"], p["k_cache"], p["v_cache"]
    by_tensor = flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=p["cache_seqlens"], causal=True)
    assert torch.equal(flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=77, causal=True), by_tensor)
    whole, lse = flash3.flash_attn_with_kvcache(q, k, v, causal=True, return_softmax_lse=True)
    check_kvcache(dict(p, cache_seqlens=None), whole, lse, causal=True)
    if device == "cpu":  # the same math as flash_attn_func's; the GPU's decoding kernel rounds its own way
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


# ---- cache layouts: cache_batch_idx, cache_leftpad, page_table; num_splits ---------------------------

def seed_of(*parts):
    """A seed that is the same in every run (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


LAYOUTS = [  # name, page_size (None: contiguous), cache_batch_idx, cache_leftpad, num_splits
    ("contiguous_split3", None, False, False, 3),
    ("batch_idx", None, True, False, 0),
    ("leftpad_split1", None, False, True, 1),
    ("batch_idx_leftpad_split64", None, True, True, 64),
    ("paged1", 1, False, False, 0),
    ("paged16_leftpad_split3", 16, False, True, 3),
    ("paged64_split64", 64, False, False, 64),
    ("paged256_leftpad", 256, False, True, 0),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_layouts_match_fp64(monkeypatch, device, layout):
    """Each layout through flash_attn_with_kvcache (lengths with 0 and around pages and 64-key
    tiles; GQA 4; 3 causal query rows): the reference's results. On the CPU also: the index
    tensors and num_splits reach forward_kvcache_into as given, and nothing is checked on the
    host (as FlashAttention-3)."""
    if device == "cpu":
        calls = stand_in.install(monkeypatch)
    name, page_size, batch_idx, leftpad, splits = layout
    p = kv_problem([0, 1, 15, 16, 17, 63, 64, 65, 200], 3, 8, 2, 64, device=device, seed=seed_of(name),
                   page_size=page_size, capacity=256, batch_idx=batch_idx, leftpad=leftpad)
    out, lse = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], **index_args(p), causal=True,
                                              num_splits=splits, return_softmax_lse=True)
    check_kvcache(p, out, lse, causal=True)
    if device == "cpu":
        (op, c), = calls
        assert op == "fwd_kvcache" and c["num_splits"] == splits
        assert not c["check_page_table"] and not c["check_seqlens"]
        assert all(c[n] is p[n] for n in INDEX)


def boundary_lengths(page_size, capacity):
    """cache_seqlens around the boundaries of pages (page_size, 2 x page_size) and of 64-key tiles,
    with 0, 1 and the whole capacity: distinct, sorted, in [0, capacity]."""
    near = {0, 1, 63, 64, 65, 127, 129, capacity}
    for n in (page_size, 2 * page_size):
        near |= {n - 1, n, n + 1}
    return sorted(x for x in near if 0 <= x <= capacity)


DECODE_CASES = [  # name, seqlen_q, nheads, nheads_kv, causal, window, softcap, num_splits, cache_leftpad
    ("decode_gqa8_causal_split3", 1, 16, 2, True, (-1, -1), 0.0, 3, False),
    ("decode_gqa16_leftpad_heuristic", 1, 32, 2, False, (-1, -1), 0.0, 0, True),
    ("spec4_gqa4_window_split64", 4, 8, 2, True, (40, -1), 0.0, 64, False),
    ("chunk130_mha_causal_leftpad_split1", 130, 2, 2, True, (-1, -1), 0.0, 1, True),
    ("spec3_gqa4_softcap_split3", 3, 8, 2, False, (-1, -1), 15.0, 3, False),
    ("decode_gqa8_local_leftpad_heuristic", 1, 16, 2, False, (100, 0), 0.0, 0, True),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged1", "paged16", "paged64", "paged256"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_matches_fp64(dtype, hdim, layout, case):
    """The kernel over every layout (contiguous; a permutation into a cache of 2 x batch + 1
    entries; pages of 1, 16, 64, 256 keys in random order) with cache_seqlens 0 and around page and
    64-key tile boundaries (boundary_lengths, up to 600 keys), cache_leftpad, num_splits 1, 3, 64
    and 0, GQA 1, 4, 8, 16, seqlen_q 1, 3, 4 and 130 (chunked prefill: rows that see no key),
    causal, windows, softcap: forward_kvcache_into into NaN-poisoned out and lse against the FP64
    reference, and flash_attn_with_kvcache the same bits."""
    name, sq, h, hk, causal, window, softcap, splits, leftpad = case
    page_size = int(layout[5:]) if layout.startswith("paged") else None
    p = kv_problem(boundary_lengths(page_size or 64, 600), sq, h, hk, hdim, dtype, "cuda",
                   seed=seed_of(name, layout, hdim), page_size=page_size, capacity=600,
                   batch_idx=layout == "batch_idx", leftpad=leftpad)
    q = p["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], h, sq), float("nan"), device="cuda")
    c, left, right = flash3.flash_attn_interface._window(window, causal)
    flash3.forward_kvcache_into(q, p["k_cache"], p["v_cache"], out, lse, causal=c, window_left=left, window_right=right,
                                softcap=softcap, num_splits=splits, **index_args(p))
    torch.cuda.synchronize()
    check_kvcache(p, out, lse, causal, window, softcap)
    out2, lse2 = flash3.flash_attn_with_kvcache(q, p["k_cache"], p["v_cache"], **index_args(p), causal=causal,
                                                window_size=window, softcap=softcap, num_splits=splits,
                                                return_softmax_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "flash_attn_with_kvcache differs from the _into call"


@gpu
def test_num_splits_agree():
    """One long-context problem (8k keys in pages of 64, GQA 8, batch 2: few blocks without a
    split) at every split count: each within the reference's tolerance, and num_splits 1 against
    the others within a few units of the last place."""
    p = kv_problem([8192, 5000], 1, 16, 2, 128, device="cuda", seed=3, page_size=64, capacity=8192)
    outs = {}
    for splits in (1, 2, 3, 7, 64, 0):
        out, lse = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], **index_args(p), causal=True,
                                                  num_splits=splits, return_softmax_lse=True)
        check_kvcache(p, out, lse, causal=True)
        outs[splits] = out
    for splits, out in outs.items():
        torch.testing.assert_close(out, outs[1], rtol=2**-6, atol=2**-8, msg=f"num_splits {splits}")


@gpu
@pytest.mark.parametrize("sequences,splits", [(24, 2), (24, 4), (8, 12), (24, 64)],
                         ids=["cluster2", "cluster4", "shared12", "last64"])
def test_split_merge_cluster_shared_and_last_block(sequences, splits):
    """The three ways of merging a split (decode_kernel.h), at head dim 128 (2 blocks per SM on an
    H100), one 16-row tile per sequence and KV head: 24 sequences x 2 KV heads at 2 / 4 splits are
    48 clusters that fit at once (merged through the cluster's shared memory); 8 x 2 at 12 splits
    (more than a cluster takes) are 192 blocks that fit at once: every block merges a share of its
    tile; 24 x 2 at 64 splits are 3072 blocks that do not, and the last block of each tile merges
    it. Lengths 0 (no key), 1, shorter than a split's keys (pieces with no key) and up to 3000;
    NaN-poisoned out and lse against the FP64 reference, twice in a row (the counters are left at
    zero for the next call)."""
    more = torch.randint(1, 3000, (sequences - 8,), generator=torch.Generator().manual_seed(splits))
    lengths = [0, 1, 63, 64, 65, 200, 700, 3000] + more.tolist()
    p = kv_problem(lengths, 1, 16, 2, 128, device="cuda", seed=11 + splits, page_size=64, capacity=3000)
    q = p["q"]
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], 16, 1), float("nan"), device="cuda")
        flash3.forward_kvcache_into(q, p["k_cache"], p["v_cache"], out, lse, causal=True, num_splits=splits,
                                    **index_args(p))
        torch.cuda.synchronize()
        check_kvcache(p, out, lse, causal=True)


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
    ("window_excluding_nothing_rotary", 3, 3, False, (1000, 1000), 32, False),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("case", APPEND_CASES, ids=[c[0] for c in APPEND_CASES])
def test_append_with_rotary(monkeypatch, device, case):
    """k, v appended at cache_seqlens (rows before and after untouched), the new keys and q rotated
    as FlashAttention-3 says (q at cache_seqlens + i when causal or local, else at cache_seqlens;
    a window bound that excludes nothing, left >= seqlen_cache - 1 or right >= seqlen_q - 1, is no
    bound), against the float64 RoPE within the input dtype's rounding; out is the attention of
    the rotated q over the cache with cache_seqlens + seqlen_new keys (the reference's results)."""
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
    local = causal or 0 <= window[0] < sc - 1 or 0 <= window[1] < sq - 1
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


def rope64(x, cos, sin, positions, interleaved):
    """RoPE in float64 as a complex rotation (vectorized; rope_reference's statement, checked
    against it): each pair (a, b) of the first 2 x cos.shape[1] dims (interleaved: dims 2i,
    2i + 1; else i, i + rotary_dim / 2) at position p becomes (a + ib)(cos(p, i) + i sin(p, i))."""
    half = cos.shape[1]
    out = x.double().clone()
    ia, ib = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half),
                                                                                slice(half, 2 * half))
    pos = positions.long()
    turn = torch.complex(cos.double()[pos], sin.double()[pos])[:, :, None, :]  # (batch, seqlen, 1, half)
    z = torch.complex(out[..., ia], out[..., ib]) * turn
    out[..., ia], out[..., ib] = z.real, z.imag
    return out


def test_cpu_rope64_is_rope_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 2, 32, generator=g)
    cos, sin = rotary_tables(20, 16, "cpu")
    positions = torch.tensor([[0, 5, 19], [7, 7, 7]])
    for interleaved in (False, True):
        torch.testing.assert_close(rope64(x, cos, sin, positions, interleaved),
                                   rope_reference(x, cos, sin, positions, interleaved), rtol=1e-12, atol=1e-12)


APPEND_LAYOUT_CASES = [  # name, layout (a page size, or "batch_idx"), seqlen_new, seqlen_q, causal, window,
    #                      rotary_dim (0: none), interleaved, cache_leftpad
    ("paged16_decode_rotary_neox", 16, 1, 1, True, (-1, -1), 64, False, False),
    ("paged16_spec5_rotary_interleaved_leftpad", 16, 5, 5, True, (-1, -1), 32, True, True),
    ("paged1_append40_causal", 1, 40, 40, True, (-1, -1), 0, False, False),
    ("paged64_append130_window_rotary_leftpad", 64, 130, 130, False, (32, 0), 64, False, True),
    ("paged256_append300_q7_noncausal_rotary", 256, 300, 7, False, (-1, -1), 64, True, False),
    ("batch_idx_append33_rotary_leftpad", "batch_idx", 33, 33, True, (-1, -1), 64, False, True),
    ("batch_idx_decode_rotary_interleaved", "batch_idx", 1, 1, False, (-1, -1), 16, True, False),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("case", APPEND_LAYOUT_CASES, ids=[c[0] for c in APPEND_LAYOUT_CASES])
def test_append_into_pages_and_entries(monkeypatch, device, case):
    """k, v (1 to 300 new rows) appended into a paged cache (across page boundaries: lengths 0,
    page_size - 1, 2 page_size + 5, 3 page_size - 1) or into the entries cache_batch_idx selects:
    each new row where page_table / cache_batch_idx put cache position cache_seqlens[b] + i, k
    rotated at that position (FlashAttention-3's: the cache position, with cache_leftpad too) and
    v as given, every other row of the cache untouched; q rotated likewise; out the attention over
    [cache_leftpad, cache_seqlens + seqlen_new) (the reference's results)."""
    if device == "cpu":
        stand_in.install(monkeypatch)
    name, layout, s_new, sq, causal, window, rot, interleaved, leftpad = case
    page_size = layout if isinstance(layout, int) else None
    unit = page_size or 64
    starts = [0, unit - 1, 2 * unit + 5, 3 * unit - 1]
    b, h, hk, d = len(starts), 8, 2, 64
    p = kv_problem(starts, sq, h, hk, d, device=device, seed=seed_of(name), page_size=page_size,
                   capacity=max(starts) + s_new + 3, batch_idx=page_size is None, leftpad=leftpad)
    g = torch.Generator(device=device).manual_seed(12)
    k_new = torch.randn(b, s_new, hk, d, generator=g, device=device).to(torch.bfloat16)
    v_new = torch.randn(b, s_new, hk, d, generator=g, device=device).to(torch.bfloat16)
    cos, sin = rotary_tables(max(starts) + max(s_new, sq) + 8, rot, device) if rot else (None, None)
    kc, vc = p["k_cache"], p["v_cache"]
    k_before, v_before = kc.clone(), vc.clone()
    out, lse = flash3.flash_attn_with_kvcache(p["q"], kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                              **index_args(p), causal=causal, window_size=window,
                                              rotary_interleaved=interleaved, return_softmax_lse=True)
    assert p["cache_seqlens"].tolist() == starts, "cache_seqlens must not change (the caller advances it)"
    start = torch.tensor(starts, device=device)[:, None]
    local = causal or window != (-1, -1)
    pos_q = start + torch.arange(sq, device=device)[None, :] if local else start.expand(b, sq)
    pos_k = start + torch.arange(s_new, device=device)[None, :]
    want_k = rope64(k_new, cos, sin, pos_k, interleaved) if rot else k_new.double()
    want_q = rope64(p["q"], cos, sin, pos_q, interleaved) if rot else p["q"].double()
    written = torch.zeros(kc.shape[:2], dtype=torch.bool, device=device)
    for e, n in enumerate(starts):
        entries, rows = cache_slots(p, e, n, n + s_new)
        torch.testing.assert_close(kc[entries, rows].double(), want_k[e], rtol=2**-7, atol=1e-6)
        assert torch.equal(vc[entries, rows], v_new[e]), f"entry {e}: v not appended as given"
        written[entries, rows] = True
    assert int(written.sum()) == b * s_new, "two sequences' new rows landed in the same cache row"
    assert torch.equal(kc[~written], k_before[~written]) and torch.equal(vc[~written], v_before[~written]), \
        "cache rows outside the append changed"
    check_kvcache(dict(p, q=want_q.to(torch.bfloat16), cache_seqlens=p["cache_seqlens"] + s_new), out, lse, causal,
                  window)


def one_rounding_apart(got, want, scale):
    """Whether every element of got (bfloat16 or float16) is within one unit in the last place of
    want's, give or take 2^-20 x scale: the same rotation in float32 done in another order (an FMA,
    say) moves a sum of terms at most `scale` in size by a few float32 units of them before its one
    rounding to 16 bits, which matters where the terms nearly cancel."""
    precision = {torch.bfloat16: 8, torch.float16: 11}[want.dtype]
    w = want.double()
    _, exponent = torch.frexp(w)
    ulp = torch.ldexp(torch.ones_like(w), exponent - precision)
    return bool(((got.double() - w).abs() <= ulp + 2**-20 * float(scale)).all())


FUSED_CASES = [  # name, layout (a page size, "contiguous" or "batch_idx"), headdim, seqlen_q, seqlen_new, causal,
    #              window, rotary_dim (0: none), interleaved, cache_leftpad, the tables' dtype (None: float32)
    ("decode_contiguous_neox", "contiguous", 128, 1, 1, True, (-1, -1), 64, False, False, None),
    ("decode_paged16_interleaved_full_leftpad", 16, 128, 1, 1, True, (-1, -1), 128, True, True, None),
    ("spec4_batch_idx_rot16", "batch_idx", 64, 4, 4, True, (-1, -1), 16, False, False, None),
    ("chunk130_paged64_window_hdim256", 64, 256, 130, 130, True, (40, -1), 256, True, True, None),
    ("noncausal_q3_paged1", 1, 64, 3, 3, False, (-1, -1), 32, False, False, None),
    ("window_right1_q3_interleaved", "contiguous", 128, 3, 3, False, (-1, 1), 64, True, False, None),
    # a window that excludes nothing is no window (FlashAttention-3's normalization): q rotated at
    # cache_seqlens, every row
    ("window_excluding_nothing_q3", "contiguous", 128, 3, 3, False, (100000, 100000), 64, False, False, None),
    ("append300_paged256_q7_no_rotary", 256, 128, 7, 300, False, (-1, -1), 0, False, True, None),
    ("decode_paged16_q_dtype_tables", 16, 64, 1, 2, True, (-1, -1), 48, True, False, "q"),
    ("spec2_q_dtype_tables_neox", "contiguous", 128, 2, 2, True, (-1, -1), 128, False, False, "q"),
    ("decode_float64_tables", "contiguous", 128, 1, 1, True, (-1, -1), 64, False, False, "float64"),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_append_matches_torch_reference(dtype, case):
    """The append inside the kernel against the torch reference (flash3.kvcache.append on a copy of
    the cache, then the kernel without an append over the lengths after it, with q rotated by the
    reference): the same cache, v bitwise and k within one rounding (the rotation in float32,
    rounded once either way), every other row untouched; out within the reference's tolerance of
    the FP64 attention over the reference's cache and rotated q, and close to the unfused call's.
    Layouts: contiguous, cache_batch_idx, pages of 1 to 256 keys (appends across page boundaries:
    lengths 0, page_size - 1, 2 page_size + 5, 3 page_size - 1), cache_leftpad; rotary_dim 16 to
    head_dim, both pair layouts, q rotated by token (causal, a window) or at cache_seqlens
    (neither; also a window that excludes nothing); tables of float32 or q's dtype (strided rows)
    read by the kernel, float64 ones converted."""
    name, layout, d, sq, s_new, causal, window, rot, interleaved, leftpad, table_dtype = case
    page_size = layout if isinstance(layout, int) else None
    unit = page_size or 64
    starts = [0, unit - 1, 2 * unit + 5, 3 * unit - 1]
    b, h, hk = len(starts), 8, 2
    capacity = max(starts) + s_new + 3
    p = kv_problem(starts, sq, h, hk, d, dtype, "cuda", seed=seed_of(name, str(dtype)), page_size=page_size,
                   capacity=capacity, batch_idx=layout == "batch_idx", leftpad=leftpad)
    g = torch.Generator(device="cuda").manual_seed(seed_of(name, "new"))
    k_new = torch.randn(b, s_new, hk, d, generator=g, device="cuda").to(dtype)
    v_new = torch.randn(b, s_new, hk, d, generator=g, device="cuda").to(dtype)
    cos = sin = None
    if rot:
        cos, sin = rotary_tables(capacity + sq + 8, rot, "cuda")
        if table_dtype == "q":  # rows of a wider table of q's dtype: read as they are by the kernel
            cos = torch.cat((cos, cos), dim=1).to(dtype)[:, :rot // 2]
            sin = torch.cat((sin, sin), dim=1).to(dtype)[:, :rot // 2]
        elif table_dtype == "float64":  # converted to float32 by flash3
            cos, sin = cos.double(), sin.double()
    kc, vc = p["k_cache"], p["v_cache"]
    k_ref, v_ref = kc.clone(), vc.clone()
    lens = p["cache_seqlens"]
    kw = dict(cache_batch_idx=p["cache_batch_idx"], cache_leftpad=p["cache_leftpad"], page_table=p["page_table"],
              causal=causal, window_size=window)
    out, lse = flash3.flash_attn_with_kvcache(p["q"], kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=lens, rotary_interleaved=interleaved,
                                              return_softmax_lse=True, **kw)
    torch.cuda.synchronize()
    assert lens.tolist() == starts, "cache_seqlens must not change (the caller advances it)"
    c, left, right = flash3.flash_attn_interface._window(window, causal)
    n_cache = kc.shape[1] * (p["page_table"].shape[1] if page_size else 1)
    by_token = flash3.kvcache.rotates_q_by_token(c, left, right, sq, n_cache)
    assert by_token == (name != "window_excluding_nothing_q3" and (causal or window != (-1, -1)))
    q_rot, lens_after = flash3.kvcache.append(p["q"], k_ref, v_ref, k_new, v_new, cos, sin, lens, interleaved,
                                              by_token, p["cache_batch_idx"], p["page_table"])
    assert torch.equal(vc, v_ref), "v_cache differs from the torch reference's"
    if rot:
        assert one_rounding_apart(kc, k_ref, k_new.abs().max()), "k_cache differs from the torch reference's"
    else:
        assert torch.equal(kc, k_ref), "k_cache (no rotary) differs from the torch reference's"
    ref = dict(p, q=q_rot, k_cache=k_ref, v_cache=v_ref, cache_seqlens=lens_after)
    check_kvcache(ref, out, lse, causal, window)
    unfused, unfused_lse = flash3.flash_attn_with_kvcache(q_rot, k_ref, v_ref, cache_seqlens=lens_after,
                                                          return_softmax_lse=True, **kw)
    torch.testing.assert_close(out, unfused, rtol=2**-6, atol=2**-7)
    torch.testing.assert_close(lse, unfused_lse, rtol=0, atol=1e-3)


@gpu
def test_cuda_graph_decode_step_with_append_replayed():
    """A decode step with an append and rotary (paged cache, num_splits 4) captured into a CUDA
    graph and replayed with new rows in k_new, v_new and new lengths in cache_seqlens (copied into
    the captured tensors, as a serving loop does): each replay writes the new rows at the new
    lengths (the torch reference's cache: v bitwise, k within one rounding) and attends to them
    (the reference's results)."""
    p = kv_problem([1, 100, 300, 17], 1, 16, 2, 128, device="cuda", seed=10, page_size=16, capacity=512)
    q, kc, vc, lens, table = p["q"], p["k_cache"], p["v_cache"], p["cache_seqlens"], p["page_table"]
    g = torch.Generator(device="cuda").manual_seed(11)
    k_new = torch.randn(4, 1, 2, 128, generator=g, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(4, 1, 2, 128, generator=g, device="cuda").to(torch.bfloat16)
    cos, sin = rotary_tables(600, 64, "cuda")

    def step():
        return flash3.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=lens, page_table=table, causal=True, num_splits=4,
                                              return_softmax_lse=True)

    graph, _, (out, lse) = capture(step)
    for new in ([2, 101, 301, 18], [0, 511, 64, 129]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        k_new.normal_(generator=g)
        v_new.normal_(generator=g)
        k_ref, v_ref = kc.clone(), vc.clone()
        q_rot, lens_after = flash3.kvcache.append(q, k_ref, v_ref, k_new, v_new, cos, sin, lens, True, True,
                                                  page_table=table)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(vc, v_ref) and one_rounding_apart(kc, k_ref, k_new.abs().max())
        check_kvcache(dict(p, q=q_rot, k_cache=k_ref, v_cache=v_ref, cache_seqlens=lens_after), out, lse, causal=True)


def test_cpu_compile_fullgraph_paged(calls):
    """torch.compile(fullgraph=True) through flash3::fwd_kvcache with page_table, cache_leftpad and
    num_splits, and the append with rotary into the pages: the same results and cache as the
    eager call; the index tensors and num_splits reach the kernel."""
    def f(q, kc, vc, k, v, cos, sin, lens, table, pad):
        return flash3.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                              cache_leftpad=pad, page_table=table, causal=True, num_splits=3,
                                              return_softmax_lse=True)

    p = kv_problem([5, 30, 17], 2, 4, 2, 64, seed=6, page_size=16, capacity=40, leftpad=True)
    g = torch.Generator().manual_seed(7)
    k, v = (torch.randn(3, 2, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = rotary_tables(48, 32, "cpu")
    args = (p["cache_seqlens"], p["page_table"], p["cache_leftpad"])
    kc, vc = p["k_cache"].clone(), p["v_cache"].clone()
    eager = f(p["q"], kc, vc, k, v, cos, sin, *args)
    got = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(p["q"], p["k_cache"], p["v_cache"], k,
                                                                                v, cos, sin, *args)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    assert torch.equal(p["k_cache"], kc) and torch.equal(p["v_cache"], vc)
    assert [name for name, _ in calls] == ["fwd_kvcache"] * 2
    c = calls[-1][1]
    assert c["num_splits"] == 3 and torch.equal(c["page_table"], p["page_table"])
    assert torch.equal(c["cache_leftpad"], p["cache_leftpad"]) and c["cache_batch_idx"] is None
    # the append reaches the kernel: the lengths before it, the new rows and the tables
    assert c["cache_seqlens"].tolist() == [5, 30, 17]
    assert torch.equal(c["k_new"], k) and torch.equal(c["v_new"], v) and c["rotary_interleaved"] is True
    assert torch.equal(c["rotary_cos"], cos) and torch.equal(c["rotary_sin"], sin)


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


OPCHECK_CASES = [  # name, kv_problem's layout keywords, seqlen_new (0: no append), rotary_dim (0: none), kwargs
    ("plain", dict(), 0, 0, dict(causal=True)),
    ("paged_append_rotary", dict(page_size=16, leftpad=True), 3, 32, dict(causal=True, rotary_interleaved=False)),
    ("batch_idx_append", dict(batch_idx=True), 2, 0, dict(window_left=20, window_right=0, num_splits=3)),
    ("append_rotary_noncausal", dict(), 1, 64, dict(softcap=5.0)),
    ("mla", dict(dv=512), 0, 0, dict(causal=True)),
    ("mla_paged_append_rotary", dict(page_size=16, dv=512), 3, 64, dict(causal=True, rotary_interleaved=False)),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_cpu_opcheck_with_stand_in(calls, case):
    """torch.library.opcheck of flash3::fwd_kvcache with the CPU stand-in (schema: the cache written
    only where declared, k_cache and v_cache; fake against real outputs; AOT dispatch with dynamic
    shapes, the cache's update included), with and without an append, with and without qv (MLA:
    out of v_cache's head dim); no input requires grad (inference only)."""
    name, layout, s_new, rot, kwargs = case
    p = kv_problem([5, 30, 17], 2, 4, 2, 64, seed=seed_of(name), capacity=40, **layout)
    extra = {} if p.get("qv") is None else dict(qv=p["qv"])
    if s_new:
        g = torch.Generator().manual_seed(13)
        extra.update(k_new=torch.randn(3, s_new, 2, 64, generator=g).to(torch.bfloat16),
                     v_new=torch.randn(3, s_new, 2, p["v_cache"].shape[3], generator=g).to(torch.bfloat16))
    if rot:
        extra["rotary_cos"], extra["rotary_sin"] = rotary_tables(48, rot, "cpu")
    args = (p["q"], p["k_cache"], p["v_cache"], p["cache_seqlens"])
    index = {n: p[n] for n in INDEX[1:] if p[n] is not None}
    torch.library.opcheck(torch.ops.flash3.fwd_kvcache.default, args, dict(kwargs, **index, **extra))
    assert calls and all(c["k_new"] is not None for _, c in calls) == bool(s_new)
    assert all((c["qv"] is not None) == ("qv" in extra) for _, c in calls)


@pytest.mark.parametrize("change, pattern", [
    (dict(v=None), r"^k and v: give both or neither"),
    (dict(k=torch.zeros(2, 3, 1, 32, dtype=torch.bfloat16)), r"^k: shape \(2, 3, 1, 32\), expected"),
    (dict(v=torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)), r"^v: seqlen_new 4 differs from k's 3"),
    (dict(k=torch.zeros(2, 3, 1, 64, dtype=torch.float16)), r"^k: torch.float16 on cpu, expected k_cache's"),
    (dict(rotary_sin=None), r"^rotary_cos and rotary_sin: give both or neither"),
    (dict(k=None, v=None), r"^rotary_cos: applies with k and v only"),
    (dict(rotary_cos=torch.zeros(10, 40), rotary_sin=torch.zeros(10, 40)), r"^rotary_cos: shape \(10, 40\); "),
    (dict(rotary_cos=torch.zeros(10, 12), rotary_sin=torch.zeros(10, 12)),
     r"^rotary_cos: shape \(10, 12\); rotary_dim = 2 x its dim 1 must be a multiple of 16 in \[16, headdim = 64\] "
     r"and seqlen_ro at least 1"),
    (dict(rotary_sin=torch.zeros(10, 8)), r"^rotary_sin: shape \(10, 8\) differs"),
    (dict(cache_seqlens=None), r"^cache_seqlens: required with k and v"),
    (dict(k=torch.zeros(2, 17, 1, 64, dtype=torch.bfloat16), v=torch.zeros(2, 17, 1, 64, dtype=torch.bfloat16)),
     r"^k: seqlen_new 17 overruns the cache: a sequence holds 16 keys \(seqlen_cache\)"),
], ids=["v_missing", "k_shape", "v_seqlen", "k_dtype", "sin_missing", "rotary_without_k", "rotary_dim",
        "rotary_dim_not_16", "sin_shape", "lens_missing", "overrun"])
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


# ---- MLA (qv): q and k_cache the rotary parts (64), qv and v_cache the latents (512) ----------------

def test_cpu_fake_shapes_mla():
    """Under FakeTensorMode, with qv: out (batch, seqlen_q, nheads, v_cache.shape[3]) of q's dtype,
    contiguous, and lse float32 (batch, nheads, seqlen_q), over a contiguous or paged cache, with
    or without an append; a qv that is not a 4-dim tensor is refused, naming it."""
    with FakeTensorMode():
        def empty(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="cuda")

        q, qv = empty(3, 2, 128, 64), empty(3, 2, 128, 512)
        k, v = empty(3, 1000, 1, 64), empty(3, 1000, 1, 512)
        pages_k, pages_v = empty(40, 64, 1, 64), empty(40, 64, 1, 512)
        lens, table = empty(3, dtype=torch.int32), empty(3, 10, dtype=torch.int32)
        append = dict(k_new=empty(3, 3, 1, 64), v_new=empty(3, 3, 1, 512), num_splits=3)
        for kc, vc, kw in ((k, v, {}), (pages_k, pages_v, dict(page_table=table)), (k, v, append)):
            out, lse = torch.ops.flash3.fwd_kvcache(q, kc, vc, lens, causal=True, qv=qv, **kw)
            assert out.shape == (3, 2, 128, 512) and out.dtype == q.dtype and out.is_contiguous()
            assert lse.shape == (3, 128, 2) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match=r"^qv: expected \(batch, seqlen_q, nheads, 512\) \(MLA: the queries' "
                                             r"latent part\), got shape \(3, 2, 512\)"):
            torch.ops.flash3.fwd_kvcache(q, k, v, lens, qv=qv[:, :, 0])


def test_cpu_mla_reaches_the_kernel(calls):
    """flash_attn_with_kvcache with qv (the eager path and the operator's, taken when an input
    requires grad): out (batch, seqlen_q, nheads, 512), qv handed to forward_kvcache_into as given,
    softmax_scale None as None (the library's default, 1/sqrt(576) with qv: the stand-in's
    reference uses it too), the reference's results (the stand-in's [q, qv] over [k, v])."""
    p = kv_problem([0, 1, 40, 64, 65], 2, 16, 1, 64, seed=21, dv=512)
    q, kc, vc, qv = p["q"], p["k_cache"], p["v_cache"], p["qv"]
    out, lse = flash3.flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=p["cache_seqlens"], causal=True,
                                              return_softmax_lse=True)
    assert out.shape == (5, 2, 16, 512) and out.dtype == q.dtype and out.is_contiguous()
    check_kvcache(p, out, lse, causal=True)
    (name, c), = calls
    assert name == "fwd_kvcache" and c["qv"] is qv and c["softmax_scale"] is None and c["out"].shape[3] == 512
    scaled = flash3.flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=p["cache_seqlens"], causal=True,
                                            softmax_scale=576 ** -0.5)
    assert torch.equal(scaled, out)
    through_op = flash3.flash_attn_with_kvcache(q, kc, vc, qv=qv.clone().requires_grad_(), cache_seqlens=p[
        "cache_seqlens"], causal=True)
    assert torch.equal(through_op, out) and len(calls) == 3


def test_cpu_compile_fullgraph_mla(calls):
    """torch.compile(fullgraph=True, dynamic=True) through flash3::fwd_kvcache with qv, a paged cache
    and an append with rotary: the same results and cache as the eager call; qv reaches the
    kernel."""
    def f(q, kc, vc, k, v, qv, cos, sin, lens, table):
        return flash3.flash_attn_with_kvcache(q, kc, vc, k, v, qv=qv, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=lens, page_table=table, causal=True,
                                              return_softmax_lse=True)

    p = kv_problem([5, 30, 17], 2, 8, 1, 64, seed=22, page_size=16, capacity=40, dv=512)
    g = torch.Generator().manual_seed(23)
    k, v = torch.randn(3, 2, 1, 64, generator=g).to(torch.bfloat16), torch.randn(3, 2, 1, 512, generator=g).to(
        torch.bfloat16)
    cos, sin = rotary_tables(48, 64, "cpu")
    args = (p["qv"], cos, sin, p["cache_seqlens"], p["page_table"])
    kc, vc = p["k_cache"].clone(), p["v_cache"].clone()
    eager = f(p["q"], kc, vc, k, v, *args)
    got = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(p["q"], p["k_cache"], p["v_cache"], k,
                                                                                v, *args)
    assert got[0].shape == (3, 2, 8, 512)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    assert torch.equal(p["k_cache"], kc) and torch.equal(p["v_cache"], vc)
    assert [name for name, _ in calls] == ["fwd_kvcache"] * 2
    assert torch.equal(calls[-1][1]["qv"], p["qv"]) and torch.equal(calls[-1][1]["v_new"], v)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """The real libflash3.so (skips where it does not load) handed CPU tensors as CUDA ones: its
    checks of shapes and dtypes all come before any pointer is inspected, and a problem with batch
    0 launches nothing, so they run without a GPU."""
    from flash3 import _kernels, _lib
    try:
        _lib.lib()
    except RuntimeError as e:
        pytest.skip(f"needs libflash3.so: {e}")
    if not _lib.has_kvcache():
        pytest.skip("this libflash3.so has no flash3_fwd_kvcache")
    monkeypatch.setattr(_kernels, "_on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_kernels, "_stream", lambda index: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))


def mla_tensors(b=2, sq=1, h=16, hk=1, sc=64, d=64, dv=512, qv_dv=512, out_dv=512, dtype=torch.bfloat16):
    """q (b, sq, h, d), k_cache (b, sc, hk, d), v_cache (b, sc, hk, dv), out (b, sq, h, out_dv), lse,
    qv (b, sq, h, qv_dv), cache_seqlens: zeros (their values are not read by these checks)."""
    return dict(q=torch.zeros(b, sq, h, d, dtype=dtype), k_cache=torch.zeros(b, sc, hk, d, dtype=dtype),
                v_cache=torch.zeros(b, sc, hk, dv, dtype=dtype), out=torch.zeros(b, sq, h, out_dv, dtype=dtype),
                lse=torch.zeros(b, h, sq), qv=torch.zeros(b, sq, h, qv_dv, dtype=dtype),
                cache_seqlens=torch.zeros(b, dtype=torch.int32))


@pytest.mark.parametrize("change, pattern", [
    (dict(d=128), r"qv is given \(MLA\): q.shape\[3\] \(head_dim\) is 128; MLA needs q's rotary part of 64 and qv's "
                  r"latent of 512$"),
    (dict(qv_dv=256, dv=256, out_dv=256), r"qv is given \(MLA\): qv.shape\[3\] \(head_dim_v\) is 256; MLA needs "),
    (dict(dv=64), r"v_cache.shape\[3\] \(head_dim_v\) is 64 but qv.shape\[3\] \(head_dim_v\) is 512; with qv \(MLA\), "
                  r"v_cache holds each key's latent"),
    (dict(out_dv=64), r"out.shape\[3\] \(head_dim_v\) is 64 but qv.shape\[3\] \(head_dim_v\) is 512; with qv \(MLA\), "
                      r"out must be \(batch, seqlen_q, nheads, 512\)"),
    (dict(qv=torch.zeros(2, 1, 16, 512, dtype=torch.float16)),
     r"qv.dtype is float16 but q.dtype is bfloat16; qv must have q's dtype$"),
    (dict(qv=torch.zeros(2, 1, 8, 512, dtype=torch.bfloat16)), r"qv.shape\[2\] \(nheads\) is 8 but q.shape\[2\] "
                                                               r"\(nheads\) is 16; qv must be"),
    (dict(k_new=torch.zeros(2, 3, 1, 512, dtype=torch.bfloat16), v_new=torch.zeros(2, 3, 1, 512, dtype=torch.bfloat16)),
     r"k_new.shape\[3\] \(head_dim\) is 512 but k_cache.shape\[3\] \(head_dim\) is 64; k_new must have the cache's "
     r"head_dim$"),
    (dict(k_new=torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16), v_new=torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16)),
     r"v_new.shape\[3\] \(head_dim_v\) is 64 but v_cache.shape\[3\] \(head_dim_v\) is 512; with qv \(MLA\), v_new must "
     r"have v_cache's head_dim_v"),
    (dict(k_new=torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16), v_new=torch.zeros(2, 3, 1, 512, dtype=torch.bfloat16),
          rotary_cos=torch.zeros(70, 64), rotary_sin=torch.zeros(70, 64)),
     r"rotary_cos.shape\[1\] \(rotary_dim / 2\) is 64, so rotary_dim is 128; rotary_dim = 2 x rotary_cos.shape\[1\] "
     r"must be a multiple of 16 in \[16, head_dim = 64\]"),
], ids=["q_not_64", "latent_not_512", "v_cache_like_k", "out_like_q", "qv_dtype", "qv_heads", "k_new_like_v",
        "v_new_like_k", "rotary_dim_128"])
def test_cpu_library_checks_mla_arguments(cpu_as_cuda, change, pattern):
    """flash3::validate_kvcache's checks of an MLA call, reached through the C struct's qv
    (forward_kvcache_into with the real library), raise ValueError with the library's message
    naming the argument; the same problem with valid shapes and batch 0 passes (nothing to
    launch)."""
    dims = {n: change[n] for n in ("d", "dv", "qv_dv", "out_dv") if n in change}
    t = mla_tensors(**dims)
    t.update({n: v for n, v in change.items() if n not in dims})
    names = ("q", "k_cache", "v_cache", "out", "lse", "cache_seqlens")
    args = [t.pop(n) for n in names]
    with pytest.raises(ValueError, match="^flash3::fwd_kvcache: " + pattern):
        flash3.forward_kvcache_into(*args, causal=True, rotary_interleaved=False, **t)
    empty = mla_tensors(b=0)
    args = [empty.pop(n) for n in names]
    out, lse = flash3.forward_kvcache_into(*args, causal=True, **empty)
    assert out is args[3] and lse is args[4]


def test_cpu_library_refuses_mla_head_dims_without_qv(cpu_as_cuda):
    """Without qv, k_cache and v_cache (and q and out) must have one shape, of head dim 64, 128 or
    256, as ever: MLA's caches without qv are refused, naming the tensor."""
    t = mla_tensors(b=0)
    del t["qv"]
    with pytest.raises(ValueError, match=r"^flash3::fwd_kvcache: out.shape\[3\] \(head_dim\) is 512 but q.shape\[3\] "
                                         r"\(head_dim\) is 64; out must have the same shape as q"):
        flash3.forward_kvcache_into(t["q"], t["k_cache"], t["v_cache"], t["out"], t["lse"], t["cache_seqlens"])
    with pytest.raises(ValueError, match=r"^flash3::fwd_kvcache: v_cache.shape\[3\] \(head_dim\) is 512 but "
                                         r"k_cache.shape\[3\] \(head_dim\) is 64; k_cache and v_cache must have the "
                                         r"same shape"):
        flash3.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], cache_seqlens=t["cache_seqlens"])
    big = mla_tensors(b=0, d=512, dv=512)
    with pytest.raises(ValueError, match=r"^flash3::fwd_kvcache: q.shape\[3\] \(head_dim\) is 512; supported head "
                                         r"dims are 64, 128, 256"):
        flash3.flash_attn_with_kvcache(big["q"], big["k_cache"], big["v_cache"], cache_seqlens=big["cache_seqlens"])


MLA_CASES = [  # name, seqlen_q, nheads, nheads_kv, causal, num_splits, softmax_scale (None: 1/sqrt(576))
    ("decode_h16_mqa_causal_split1", 1, 16, 1, True, 1, None),
    ("decode_h128_mqa_split3", 1, 128, 1, False, 3, None),
    ("decode_h128_mqa_causal_heuristic", 1, 128, 1, True, 0, None),
    ("decode_h8_gqa4_split3", 1, 8, 2, False, 3, None),
    ("spec2_h16_mqa_heuristic", 2, 16, 1, False, 0, None),
    ("spec2_h128_mqa_causal_split3", 2, 128, 1, True, 3, None),
    ("spec2_h8_gqa4_causal_split1_scale", 2, 8, 2, True, 1, 0.07),
    ("spec5_h16_mqa_causal_split3", 5, 16, 1, True, 3, None),
    ("spec5_h8_gqa4_heuristic", 5, 8, 2, False, 0, None),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged1", "paged64", "paged256"])
@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_decode_matches_fp64(dtype, layout, case):
    """MLA decoding (q, k_cache (..., 64); qv, v_cache (..., 512)) over a contiguous cache or pages of
    1, 64, 256 keys in random order, cache_seqlens 0 and around page and 64-key tile boundaries
    (boundary_lengths, up to 600 keys), 16 and 128 query heads over one KV head and 8 over 2,
    seqlen_q 1, 2 and 5 (causal: rows that see no key), num_splits 1, 3 and 0, the default scale
    1/sqrt(576) and a given one: forward_kvcache_into into NaN-poisoned out (batch, seqlen_q,
    nheads, 512) and lse against the FP64 reference of [q, qv] over [k, v] with v as the values
    (check_kvcache), and flash_attn_with_kvcache the same bits."""
    name, sq, h, hk, causal, splits, scale = case
    page_size = int(layout[5:]) if layout.startswith("paged") else None
    p = kv_problem(boundary_lengths(page_size or 64, 600), sq, h, hk, 64, dtype, "cuda",
                   seed=seed_of("mla", name, layout, str(dtype)), page_size=page_size, capacity=600, dv=512)
    q, qv, kc, vc = p["q"], p["qv"], p["k_cache"], p["v_cache"]
    out = torch.full((*q.shape[:3], 512), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((q.shape[0], h, sq), float("nan"), device="cuda")
    flash3.forward_kvcache_into(q, kc, vc, out, lse, softmax_scale=scale, causal=causal, num_splits=splits, qv=qv,
                                **index_args(p))
    torch.cuda.synchronize()
    check_kvcache(p, out, lse, causal, scale=scale)
    out2, lse2 = flash3.flash_attn_with_kvcache(q, kc, vc, qv=qv, **index_args(p), softmax_scale=scale, causal=causal,
                                                num_splits=splits, return_softmax_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "flash_attn_with_kvcache differs from the _into call"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_mla_append_with_rotary(monkeypatch, device, dtype, layout):
    """MLA with an append of 3 new tokens (k (..., 64), v (..., 512)) rotated by rotary_dim 64, not
    interleaved, causal, 3 query rows, 16 query heads over one KV head, into a contiguous cache or
    pages of 16 (across page boundaries: lengths 0, page_size - 1, 2 page_size + 5, 3 page_size -
    1): the cache as the torch reference leaves it (flash3.kvcache.append on a copy: v bitwise, k
    within one rounding, every other row untouched) and the new keys within rounding of the
    float64 RoPE; cache_seqlens and qv unchanged (qv is not rotated); out (batch, 3, 16, 512)
    within the reference's tolerance of the FP64 attention of the rotated q and qv over the
    reference's cache, and close to the call without the append over that cache."""
    if device == "cpu":
        stand_in.install(monkeypatch)
    page_size = 16 if layout == "paged16" else None
    unit = page_size or 64
    starts = [0, unit - 1, 2 * unit + 5, 3 * unit - 1]
    b, h, hk, sq, s_new = len(starts), 16, 1, 3, 3
    capacity = max(starts) + s_new + 3
    p = kv_problem(starts, sq, h, hk, 64, dtype, device, seed=seed_of("mla_append", layout, str(dtype)),
                   page_size=page_size, capacity=capacity, dv=512)
    g = torch.Generator(device=device).manual_seed(seed_of("mla_append", "new"))
    k_new = torch.randn(b, s_new, hk, 64, generator=g, device=device).to(dtype)
    v_new = torch.randn(b, s_new, hk, 512, generator=g, device=device).to(dtype)
    cos, sin = rotary_tables(capacity + sq + 8, 64, device)
    kc, vc, lens, qv, table = p["k_cache"], p["v_cache"], p["cache_seqlens"], p["qv"], p["page_table"]
    k_ref, v_ref, qv_before = kc.clone(), vc.clone(), qv.clone()
    out, lse = flash3.flash_attn_with_kvcache(p["q"], kc, vc, k_new, v_new, qv=qv, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=lens, page_table=table, causal=True,
                                              rotary_interleaved=False, return_softmax_lse=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert out.shape == (b, sq, h, 512)
    assert lens.tolist() == starts, "cache_seqlens must not change (the caller advances it)"
    assert torch.equal(qv, qv_before)
    q_rot, lens_after = flash3.kvcache.append(p["q"], k_ref, v_ref, k_new, v_new, cos, sin, lens, False, True,
                                              page_table=table)
    assert torch.equal(vc, v_ref), "v_cache differs from the torch reference's"
    assert one_rounding_apart(kc, k_ref, k_new.abs().max()), "k_cache differs from the torch reference's"
    pos_k = torch.tensor(starts, device=device)[:, None] + torch.arange(s_new, device=device)[None, :]
    want_k = rope64(k_new, cos, sin, pos_k, False)
    for e, n in enumerate(starts):
        entries, rows = cache_slots(p, e, n, n + s_new)
        torch.testing.assert_close(kc[entries, rows].double(), want_k[e], rtol=2**-7, atol=1e-6)
        assert torch.equal(vc[entries, rows], v_new[e]), f"entry {e}: v not appended as given"
    check_kvcache(dict(p, q=q_rot, k_cache=k_ref, v_cache=v_ref, cache_seqlens=lens_after), out, lse, causal=True)
    unfused, unfused_lse = flash3.flash_attn_with_kvcache(q_rot, k_ref, v_ref, qv=qv, cache_seqlens=lens_after,
                                                          page_table=table, causal=True, return_softmax_lse=True)
    torch.testing.assert_close(out, unfused, rtol=2**-6, atol=2**-7)
    torch.testing.assert_close(lse, unfused_lse, rtol=0, atol=1e-3)


# ---- arguments ----------------------------------------------------------------------------------------

UNSUPPORTED = ["cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q", "rotary_seqlens", "q_descale", "k_descale",
               "v_descale"]


@pytest.mark.parametrize("name", UNSUPPORTED + ["attention_chunk"])
def test_cpu_unsupported_arguments_raise_naming_them(calls, name):
    p = problem(2, 1, 16, 2, 1, 64)
    value = 128 if name == "attention_chunk" else torch.zeros(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=rf"^{name}=.* is not supported by flash3"):
        flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                       **{name: value})
    assert calls == []


def test_cpu_speed_hints_accepted_and_ignored(calls):
    """pack_gqa and sm_margin are accepted and ignored; num_splits is passed on (the results do not
    depend on it beyond rounding)."""
    p = problem(2, 1, 16, 2, 1, 64, seed=3)
    base = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"])
    hinted = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                            num_splits=4, pack_gqa=True, sm_margin=8, rotary_interleaved=False)
    assert torch.equal(base, hinted)
    assert [c["num_splits"] for _, c in calls] == [0, 4]


def test_cpu_scheduler_metadata_accepted_and_not_read(calls):
    """get_scheduler_metadata (FlashAttention-3's arguments) returns an empty int32 tensor on
    cache_seqlens' device; flash_attn_with_kvcache takes it (or any int32 tensor) with the same
    results, and names it when it is not an int32 tensor."""
    p = problem(2, 1, 16, 2, 1, 64, seed=4)
    meta = flash3.get_scheduler_metadata(2, 1, 16, 2, 1, 64, p["cache_seqlens"], torch.bfloat16, causal=True,
                                         page_size=None, num_splits=0)
    assert meta.dtype == torch.int32 and meta.numel() == 0 and meta.device == p["cache_seqlens"].device
    base = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"])
    with_meta = flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                               scheduler_metadata=meta)
    assert torch.equal(base, with_meta)
    for bad, shown in ((torch.zeros(2), "torch.float32 tensor"), ([0], "list")):
        with pytest.raises(ValueError, match=rf"^scheduler_metadata: .*got {shown}"):
            flash3.flash_attn_with_kvcache(p["q"], p["k_cache"], p["v_cache"], cache_seqlens=p["cache_seqlens"],
                                           scheduler_metadata=bad)
    with pytest.raises(ValueError, match="^cache_seqlens: expected a torch.Tensor"):
        flash3.get_scheduler_metadata(2, 1, 16, 2, 1, 64, None)
    assert len(calls) == 2


def _int32(*shape, dtype=torch.int32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("change, error, pattern", [
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), ValueError, r"^cache_seqlens: dtype torch.int64"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, r"^cache_seqlens: shape \(3,\), expected"),
    (dict(cache_seqlens=torch.zeros(2, 1, dtype=torch.int32)), ValueError, r"^cache_seqlens: expected shape"),
    (dict(cache_seqlens=_int32(2, device="meta")), ValueError, r"^cache_seqlens: on device meta but q is on cpu"),
    (dict(cache_seqlens=-1), ValueError, r"^cache_seqlens: -1 is out of range"),
    (dict(cache_seqlens=1.5), ValueError, r"^cache_seqlens: expected an int"),
    (dict(cache_batch_idx=_int32(2, dtype=torch.float32)), ValueError,
     r"^cache_batch_idx: dtype torch.float32 is not supported; cache_batch_idx must be torch.int32"),
    (dict(cache_batch_idx=_int32(3)), ValueError, r"^cache_batch_idx: shape \(3,\), expected \(batch,\) = \(2,\)"),
    (dict(cache_batch_idx=_int32(2, device="meta")), ValueError, r"^cache_batch_idx: on device meta"),
    (dict(cache_batch_idx=[0, 1]), ValueError, r"^cache_batch_idx: expected a torch.Tensor"),
    (dict(cache_leftpad=_int32(2, dtype=torch.int16)), ValueError, r"^cache_leftpad: dtype torch.int16"),
    (dict(cache_leftpad=_int32(2, 1)), ValueError, r"^cache_leftpad: expected shape \(batch,\), got shape \(2, 1\)"),
    (dict(cache_leftpad=_int32(2, device="meta")), ValueError, r"^cache_leftpad: on device meta"),
    (dict(page_table=_int32(2, 4, dtype=torch.int64)), ValueError,
     r"^page_table: dtype torch.int64 is not supported; page_table must be torch.int32"),
    (dict(page_table=_int32(3, 4)), ValueError,
     r"^page_table: shape \(3, 4\), expected \(batch, max_pages_per_seq\) with batch = 2"),
    (dict(page_table=_int32(2)), ValueError, r"^page_table: shape \(2,\), expected \(batch, max_pages_per_seq\)"),
    (dict(page_table=_int32(2, 4, device="meta")), ValueError, r"^page_table: on device meta but q is on cpu"),
    (dict(page_table=[[0], [1]]), ValueError, r"^page_table: expected a torch.Tensor \(torch.int32"),
    (dict(page_table=_int32(2, 4), cache_batch_idx=_int32(2)), ValueError,
     r"^cache_batch_idx: not supported with page_table; a paged cache is addressed through page_table alone"),
    (dict(num_splits=65), ValueError, r"^num_splits: must be an int in \[0, 64\] \(key-range splits; 0: flash3's "
                                      r"heuristic\), got 65"),
    (dict(num_splits=-1), ValueError, r"^num_splits: must be an int in \[0, 64\]"),
    (dict(num_splits=2.0), ValueError, r"^num_splits: must be an int, got float"),
    (dict(k_cache=torch.zeros(2, 16, 64)), ValueError, r"^k_cache: expected \(batch_cache, seqlen_cache"),
    (dict(k_cache=torch.zeros(2, 16, 64), page_table=_int32(2, 4)), ValueError,
     r"^k_cache: expected \(num_pages, page_size, nheads_kv, headdim\) \(a paged cache: page_table given\)"),
    (dict(q=torch.zeros(2, 2, 64)), ValueError, r"^q: expected \(batch, seqlen_q"),
    (dict(window_size=(1, 2, 3)), ValueError, r"^window_size"),
    (dict(qv=torch.zeros(2, 1, 512, dtype=torch.bfloat16)), ValueError,
     r"^qv: expected \(batch, seqlen_q, nheads, 512\) \(MLA: the queries' latent part\), got shape \(2, 1, 512\)"),
    (dict(qv=[0.0]), ValueError, r"^qv: expected a torch.Tensor, got list"),
], ids=["lens_dtype", "lens_length", "lens_rank", "lens_device", "lens_negative_int", "lens_float", "idx_dtype",
        "idx_length", "idx_device", "idx_list", "pad_dtype", "pad_rank", "pad_device", "table_dtype", "table_rows",
        "table_rank", "table_device", "table_list", "idx_with_table", "splits_65", "splits_negative", "splits_float",
        "k_rank", "k_rank_paged", "q_rank", "window", "qv_rank", "qv_list"])
def test_cpu_bad_arguments_raise_naming_them(calls, change, error, pattern):
    """Before anything runs (no call, the cache unchanged, also with an append)."""
    p = problem(2, 1, 16, 2, 1, 64)
    args = dict(q=p["q"], k_cache=p["k_cache"], v_cache=p["v_cache"], cache_seqlens=p["cache_seqlens"])
    args.update(change)
    with pytest.raises(error, match=pattern):
        flash3.flash_attn_with_kvcache(**args)
    before = p["k_cache"].clone()
    if "k_cache" not in change and "q" not in change and "window_size" not in change and isinstance(
            args["cache_seqlens"], torch.Tensor):
        new = torch.zeros(2, 1, 1, 64, dtype=torch.bfloat16)
        with pytest.raises(error, match=pattern):
            flash3.flash_attn_with_kvcache(**args, k=new, v=new)
        assert torch.equal(p["k_cache"], before)
    assert calls == []


# ---- the C struct and the host-side checks (forward_kvcache_into with a C function as the library) ----

C_PROBE = r"""
#include <stdint.h>
#include "flash3/flash3_c.h"
static double seen[53];
static int calls;
const double* probe_seen(void) { return seen; }
int probe_calls(void) { return calls; }
uint64_t probe_layout(int i) {
  const uint64_t v[] = {sizeof(flash3_kvcache_args), FLASH3_KVCACHE_ARGS_SIZE_V1, FLASH3_KVCACHE_ARGS_SIZE_V2,
                        offsetof(flash3_kvcache_args, causal), offsetof(flash3_kvcache_args, softmax_scale),
                        offsetof(flash3_kvcache_args, num_splits), offsetof(flash3_kvcache_args, q),
                        offsetof(flash3_kvcache_args, k_cache), offsetof(flash3_kvcache_args, v_cache),
                        offsetof(flash3_kvcache_args, out), offsetof(flash3_kvcache_args, lse),
                        offsetof(flash3_kvcache_args, cache_seqlens), offsetof(flash3_kvcache_args, cache_batch_idx),
                        offsetof(flash3_kvcache_args, cache_leftpad), offsetof(flash3_kvcache_args, page_table),
                        offsetof(flash3_kvcache_args, window), offsetof(flash3_kvcache_args, window_left),
                        offsetof(flash3_kvcache_args, window_right), offsetof(flash3_kvcache_args, softcap),
                        offsetof(flash3_kvcache_args, stream), offsetof(flash3_kvcache_args, k_new),
                        offsetof(flash3_kvcache_args, v_new), offsetof(flash3_kvcache_args, rotary_cos),
                        offsetof(flash3_kvcache_args, rotary_sin), offsetof(flash3_kvcache_args, qv),
                        offsetof(flash3_kvcache_args, rotary_interleaved), offsetof(flash3_kvcache_args, reserved_v2)};
  return v[i];
}
int probe_fwd_kvcache(const flash3_kvcache_args* a, char* err, int n) {
  const double v[] = {a->struct_size, a->causal, a->softmax_scale, a->num_splits, a->window, a->window_left,
                      a->window_right, a->softcap, (double)(uintptr_t)a->stream,
                      a->q.rank, (double)a->q.shape[1], (double)a->k_cache.shape[0], (double)a->k_cache.shape[1],
                      a->v_cache.rank, (double)a->out.shape[2], a->lse.data != 0, a->lse.rank,
                      a->cache_seqlens.rank, a->cache_seqlens.dtype, (double)a->cache_seqlens.shape[0],
                      a->cache_batch_idx.data != 0, a->cache_batch_idx.rank,
                      a->cache_leftpad.rank, (double)a->cache_leftpad.shape[0],
                      a->page_table.rank, a->page_table.dtype, (double)a->page_table.shape[0],
                      (double)a->page_table.shape[1], (double)a->page_table.stride[0],
                      (double)a->page_table.stride[1]};
  for (int i = 0; i < 30; ++i) seen[i] = v[i];
  for (int i = 30; i < 53; ++i) seen[i] = -1;  /* a v1 struct: the append's fields and qv are not there */
  if (a->struct_size >= FLASH3_KVCACHE_ARGS_SIZE_V2) {
    const double w[] = {a->k_new.rank, a->k_new.dtype, (double)a->k_new.shape[1], (double)a->k_new.shape[2],
                        (double)a->k_new.stride[1], a->v_new.rank, (double)a->v_new.shape[1],
                        (double)a->v_new.stride[0], a->rotary_cos.rank, a->rotary_cos.dtype,
                        (double)a->rotary_cos.shape[0], (double)a->rotary_cos.shape[1],
                        (double)a->rotary_cos.stride[0], a->rotary_sin.rank, a->rotary_sin.dtype,
                        (double)a->rotary_sin.stride[0], a->rotary_interleaved, a->reserved_v2,
                        a->qv.rank, a->qv.dtype, (double)a->qv.shape[0], (double)a->qv.shape[3],
                        (double)a->qv.stride[2]};
    for (int i = 0; i < 23; ++i) seen[30 + i] = w[i];
  }
  ++calls;
  (void)err; (void)n;
  return 0;
}
"""
LAYOUT_FIELDS = ("causal", "softmax_scale", "num_splits", "q", "k_cache", "v_cache", "out", "lse", "cache_seqlens",
                 "cache_batch_idx", "cache_leftpad", "page_table", "window", "window_left", "window_right", "softcap",
                 "stream", "k_new", "v_new", "rotary_cos", "rotary_sin", "qv", "rotary_interleaved", "reserved_v2")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """C_PROBE built against include/flash3/flash3_c.h in the library's place (flash3_fwd_kvcache
    records the fields it reads), CPU tensors let through as CUDA ones; skips without a C
    compiler."""
    from flash3 import _kernels, _lib
    lib = c_probe.build(tmp_path, C_PROBE)
    lib.probe_layout.restype = ctypes.c_uint64
    lib.probe_seen.restype = ctypes.POINTER(ctypes.c_double)
    lib.probe_fwd_kvcache.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.flash3_fwd_kvcache = lib.probe_fwd_kvcache
    monkeypatch.setattr(_lib, "lib", lambda: lib)
    monkeypatch.setattr(_kernels, "_on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_kernels, "_stream", lambda index: 0x5000)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    return lib


def test_cpu_kvcache_args_match_c_header(probe):
    """The struct forward_kvcache_into packs has the layout of flash3_kvcache_args as a C compiler
    lays it out (the size, every field's offset), and a C function reads back the values packed:
    the flags and numbers, the tensors' ranks, dtypes, shapes and strides, "not given" (NULL data,
    rank 0) for the index tensors left out. Without an append or qv the first version (760 bytes)
    is packed; with either the second (1168 bytes: k_new, v_new, rotary_cos, rotary_sin, qv,
    rotary_interleaved), the rotary tables as given when of q's dtype or float32, with the last dim
    contiguous, else as float32 copies; qv (MLA) as given, softmax_scale None as 0 (the library's
    default, 1/sqrt(576) with qv)."""
    from flash3 import _kernels, _lib
    layout = [probe.probe_layout(i) for i in range(3 + len(LAYOUT_FIELDS))]
    assert layout[:3] == [_lib.KVCACHE_ARGS_SIZE, _lib.KVCACHE_ARGS_SIZE_V1, _lib.KVCACHE_ARGS_SIZE] == [
        _kernels._KVCACHE_APPEND.size, _kernels._KVCACHE.size, _kernels._KVCACHE_APPEND.size] == [1168, 760, 1168]
    assert layout[3:] == [getattr(_lib.KvcacheArgs, f).offset for f in LAYOUT_FIELDS]
    assert _lib.has_kvcache()

    def seen():
        return [probe.probe_seen()[i] for i in range(30)]

    def seen_v2():
        return [probe.probe_seen()[i] for i in range(30, 48)]

    def seen_qv():
        return [probe.probe_seen()[i] for i in range(48, 53)]

    p = kv_problem([5, 40, 17], 2, 8, 2, 64, seed=1, page_size=16, capacity=48, leftpad=True)
    q, kc, vc = p["q"], p["k_cache"], p["v_cache"]
    out, lse = torch.empty_like(q), torch.empty(3, 8, 2)
    table = torch.zeros(3, 8, dtype=torch.int32)[:, :3]  # rows of a wider table
    flash3.forward_kvcache_into(q, kc, vc, out, lse, p["cache_seqlens"], 0.5, True, 7, -1, 2.5, None,
                                p["cache_leftpad"], table, 64)
    assert seen() == [760, 1, 0.5, 64, 1, 7, -1, 2.5, 0x5000, 4, 2, 12, 16, 4, 8, 1, 3, 1, 5, 3, 0, 0, 1, 3, 2, 5, 3,
                      3, 8, 1]
    flash3.forward_kvcache_into(q, kc[:3, :4].contiguous(), vc[:3, :4].contiguous(), out, None, cache_batch_idx=p[
        "cache_seqlens"])
    assert seen()[:9] == [760, 0, 0.0, 0, 0, -1, -1, 0.0, 0x5000]
    assert seen()[15:] == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert seen_v2() == [-1] * 18 and seen_qv() == [-1] * 5
    assert probe.probe_calls() == 2
    # the append: k_new, v_new as given (v_new a slice: its strides), tables of q's dtype (bfloat16)
    # as given (rows of a wider table: stride 48); rotary_interleaved True by default
    k_new = torch.zeros(3, 5, 2, 64, dtype=torch.bfloat16)
    v_new = torch.zeros(3, 9, 2, 64, dtype=torch.bfloat16)[:, 2:7]
    cos = torch.zeros(50, 48, dtype=torch.bfloat16)[:, :16]
    flash3.forward_kvcache_into(q, kc, vc, out, lse, p["cache_seqlens"], page_table=table, k_new=k_new, v_new=v_new,
                                rotary_cos=cos, rotary_sin=cos)
    assert seen()[0] == 1168 and seen()[17:] == [1, 5, 3, 0, 0, 0, 0, 2, 5, 3, 3, 8, 1]
    assert seen_v2() == [4, 1, 5, 2, 128, 4, 5, 9 * 128, 2, 1, 50, 16, 48, 2, 1, 48, 1, 0]
    assert seen_qv() == [0] * 5  # not given
    # float16 tables (neither float32 nor q's dtype), or two dtypes: converted to float32, contiguous
    for c, s in ((cos.half(), cos.half()), (cos, cos.float())):
        flash3.forward_kvcache_into(q, kc, vc, out, lse, p["cache_seqlens"], page_table=table, k_new=k_new,
                                    v_new=v_new, rotary_cos=c, rotary_sin=s)
        assert seen_v2() == [4, 1, 5, 2, 128, 4, 5, 9 * 128, 2, 2, 50, 16, 16, 2, 2, 16, 1, 0]
    flash3.forward_kvcache_into(q, kc, vc, out, lse, p["cache_seqlens"], page_table=table, k_new=k_new, v_new=v_new,
                                rotary_interleaved=False)
    assert seen_v2() == [4, 1, 5, 2, 128, 4, 5, 9 * 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    # qv (MLA) without an append: the second version, the append's tensors not given, qv as given
    # (the latent part of a wider projection: its strides); softmax_scale None packs 0
    qv = torch.zeros(3, 2, 8, 576, dtype=torch.bfloat16)[..., 64:]
    flash3.forward_kvcache_into(q, kc, vc, out, lse, p["cache_seqlens"], page_table=table, qv=qv)
    assert seen()[:4] == [1168, 0, 0.0, 0] and seen()[17:] == [1, 5, 3, 0, 0, 0, 0, 2, 5, 3, 3, 8, 1]
    assert seen_v2() == [0] * 16 + [1, 0]  # rotary_interleaved as given (True), unread without rotary
    assert seen_qv() == [4, 1, 3, 512, 576]
    # and with an append
    flash3.forward_kvcache_into(q, kc, vc, out, lse, p["cache_seqlens"], page_table=table, k_new=k_new, v_new=v_new,
                                rotary_cos=cos, rotary_sin=cos, rotary_interleaved=False, qv=qv)
    assert seen()[0] == 1168
    assert seen_v2() == [4, 1, 5, 2, 128, 4, 5, 9 * 128, 2, 1, 50, 16, 48, 2, 1, 48, 0, 0]
    assert seen_qv() == [4, 1, 3, 512, 576]
    assert probe.probe_calls() == 8


def test_cpu_forward_kvcache_into_names_bad_tensors(probe):
    """What the library cannot be handed (not a tensor, a dtype it has no code for, rank > 4) is
    refused before the call, naming the argument (the append's k_new, v_new, rotary_cos, rotary_sin
    and MLA's qv too); so are num_splits and softmax_scale."""
    p = kv_problem([5, 40], 1, 4, 2, 64, page_size=16, capacity=48)
    q, kc, vc = p["q"], p["k_cache"], p["v_cache"]
    out = torch.empty_like(q)
    new, cos = torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16), torch.zeros(8, 16)
    cases = [(dict(page_table=p["page_table"].long()), r"^page_table: dtype torch.int64 is not supported \(use "
                                                       r"torch.int32\)"),
             (dict(page_table=p["page_table"], cache_leftpad=[0, 1]), r"^cache_leftpad: expected a torch.Tensor"),
             (dict(cache_batch_idx=torch.zeros(2, dtype=torch.int16)), r"^cache_batch_idx: dtype torch.int16"),
             (dict(page_table=p["page_table"], num_splits=99), r"^num_splits: must be an int in \[0, 64\]"),
             (dict(softmax_scale=float("inf")), r"^softmax_scale"),
             (dict(k_new=new.long(), v_new=new), r"^k_new: dtype torch.int64 is not supported \(use torch.bfloat16 "
                                                 r"or torch.float16\)"),
             (dict(k_new=new, v_new=new[None]), r"^v_new: rank 5 is not supported \(at most 4\)"),
             (dict(k_new=new, v_new=new, rotary_cos=[[1.0]], rotary_sin=cos), r"^rotary_cos: expected a torch.Tensor, "
                                                                              r"got list"),
             (dict(k_new=new, v_new=new, rotary_cos=cos, rotary_sin=cos.long()), r"^rotary_sin: dtype torch.int64 is "
                                                                                 r"not supported \(use torch.float32 or q's dtype\)"),
             (dict(qv=new.long()), r"^qv: dtype torch.int64 is not supported \(use torch.bfloat16 or torch.float16\)"),
             (dict(qv=new[None]), r"^qv: rank 5 is not supported \(at most 4\)"),
             (dict(qv=[[1.0]]), r"^qv: expected a torch.Tensor, got list")]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            flash3.forward_kvcache_into(q, kc, vc, out, None, p["cache_seqlens"], **kw)
    assert probe.probe_calls() == 0


def test_cpu_check_page_table_reports_the_first_bad_page(probe):
    """check_page_table=True: every page a sequence reads (slots 0 .. ceil(cache_seqlens[b] /
    page_size) - 1 of its row; every slot without cache_seqlens) in [0, num_pages), else
    ValueError naming page_table, the batch entry, the slot and the value of the first bad one
    (row by row), before the library is called; slots past a sequence's pages are not read and
    may hold anything. Off (the default), nothing is checked."""
    p = kv_problem([5, 50, 33], 1, 4, 2, 64, page_size=16, capacity=64)  # 4 slots per row, 15 pages
    q, kc, vc, lens, table = p["q"], p["k_cache"], p["v_cache"], p["cache_seqlens"], p["page_table"]
    out = torch.empty_like(q)
    table[0, 3] = 99  # slot 3 of a 5-key sequence: not read
    table[2, 0] = -1
    table[1, 3] = 15

    def call(**kw):
        flash3.forward_kvcache_into(q, kc, vc, out, None, lens, page_table=table, **kw)

    with pytest.raises(ValueError, match=r"^page_table: page_table\[1, 3\] is 15; batch entry 1 reads the pages in "
                                         r"slots 0 \.\. 3 of its row: ceil\(cache_seqlens\[1\] / page_size\) = "
                                         r"ceil\(50 / 16\), and each must be in \[0, num_pages\) = \[0, 15\) "
                                         r"\(k_cache.shape\[0\]\)$"):
        call(check_page_table=True)
    table[1, 3] = 14
    with pytest.raises(ValueError, match=r"^page_table: page_table\[2, 0\] is -1; batch entry 2 reads the pages in "
                                         r"slots 0 \.\. 2 of its row"):
        call(check_page_table=True)
    assert probe.probe_calls() == 0
    call()  # unchecked: passed on
    table[2, 0] = 0
    call(check_page_table=True)
    assert probe.probe_calls() == 2
    lens[0] = 99  # a length past the cache reads every slot (the library clamps it): slot 3 now counts
    with pytest.raises(ValueError, match=r"^page_table: page_table\[0, 3\] is 99; batch entry 0 reads the pages in "
                                         r"slots 0 \.\. 3 of its row: ceil\(cache_seqlens\[0\] / page_size\) = "
                                         r"ceil\(64 / 16\)"):
        call(check_page_table=True)
    with pytest.raises(ValueError, match=r"^page_table: page_table\[0, 3\] is 99; batch entry 0 reads the pages in "
                                         r"slots 0 \.\. 3 of its row, and each"):
        flash3.forward_kvcache_into(q, kc, vc, out, None, None, page_table=table, check_page_table=True)
    assert probe.probe_calls() == 2


def test_cpu_check_seqlens_reports_the_first_bad_value(probe):
    """check_seqlens=True: cache_seqlens in [0, seqlen_cache], cache_leftpad in [0, cache_seqlens],
    cache_batch_idx in [0, batch_cache), else ValueError naming the tensor, the entry and the
    value, before the library is called."""
    p = kv_problem([10, 64, 3], 1, 4, 1, 128, capacity=64, batch_idx=True, leftpad=True)
    q, kc, vc = p["q"], p["k_cache"], p["v_cache"]
    out = torch.empty_like(q)
    kw = index_args(p)

    def call():
        flash3.forward_kvcache_into(q, kc, vc, out, None, **kw, check_seqlens=True)

    call()
    kw["cache_seqlens"] = torch.tensor([10, 65, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cache_seqlens: cache_seqlens\[1\] is 65; it must be in \[0, "
                                         r"seqlen_cache\] = \[0, 64\] \(k_cache.shape\[1\]\)$"):
        call()
    kw["cache_seqlens"] = torch.tensor([10, 64, 3], dtype=torch.int32)
    kw["cache_leftpad"] = torch.tensor([0, 3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cache_leftpad: cache_leftpad\[2\] is 4; it must be in \[0, "
                                         r"cache_seqlens\[2\]\] = \[0, 3\]$"):
        call()
    kw["cache_leftpad"] = None
    kw["cache_batch_idx"] = torch.tensor([0, 7, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cache_batch_idx: cache_batch_idx\[1\] is 7; it must be in \[0, "
                                         r"batch_cache\) = \[0, 7\) \(k_cache.shape\[0\]\)$"):
        call()
    assert probe.probe_calls() == 1
    pp = kv_problem([10, 40], 1, 4, 1, 128, page_size=16, capacity=48)
    with pytest.raises(ValueError, match=r"^cache_seqlens: cache_seqlens\[0\] is 49; it must be in \[0, "
                                         r"seqlen_cache\] = \[0, 48\] \(page_table.shape\[1\] x page_size = 3 x 16\)"):
        flash3.forward_kvcache_into(pp["q"], pp["k_cache"], pp["v_cache"], out[:2], None,
                                    torch.tensor([49, 1], dtype=torch.int32), page_table=pp["page_table"],
                                    check_seqlens=True)


def test_cpu_value_checks_skip_while_capturing(monkeypatch):
    """Under CUDA-graph capture (the values of a replay are not those of the capture) the host
    does not read the index tensors."""
    p = kv_problem([5, 50], 1, 4, 2, 64, page_size=16, capacity=64)
    p["page_table"][1, 0] = -7
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] is -7"):
        flash3._kernels.check_kvcache_values(p["k_cache"], p["cache_seqlens"], page_table=p["page_table"])
    monkeypatch.setattr(flash3._kernels, "_capturing", lambda: True)
    flash3._kernels.check_kvcache_values(p["k_cache"], p["cache_seqlens"], page_table=p["page_table"])


# ---- GPU only ---------------------------------------------------------------------------------------

@gpu
def test_cache_seqlens_past_the_cache():
    """A length above seqlen_cache: unchecked (the default), it counts as seqlen_cache; with
    check_seqlens=True the host-side check raises naming cache_seqlens (also after an in-place
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


@gpu
def test_cuda_graph_paged_split_decode_step_replayed():
    """A decode step over a paged cache with num_splits 4 captured into a CUDA graph (the eager
    warm-up on the capture stream allocates the split's scratch memory) and replayed after
    cache_seqlens, and then page_table, changed in place: each replay attends to the new lengths
    through the new pages (the reference's results; the eager warm-up's too)."""
    p = kv_problem([1, 100, 511, 256], 1, 16, 2, 128, device="cuda", seed=8, page_size=16, capacity=512)
    q, k, v, lens, table = p["q"], p["k_cache"], p["v_cache"], p["cache_seqlens"], p["page_table"]
    p["cache_leftpad"] = torch.tensor([0, 50, 30, 0], dtype=torch.int32, device="cuda")  # within every length below

    def step():
        return flash3.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=p["cache_leftpad"],
                                              page_table=table, causal=True, num_splits=4, return_softmax_lse=True)

    graph, eager, (out, lse) = capture(step)
    check_kvcache(p, *eager, causal=True)
    g = torch.Generator().manual_seed(9)
    for new, shuffle in (([2, 101, 512, 300], False), ([300, 107, 64, 429], True)):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        if shuffle:  # other pages, in another order
            table.copy_(torch.randperm(k.shape[0], generator=g)[:table.numel()].view_as(table).to(table))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_kvcache(p, out, lse, causal=True)
