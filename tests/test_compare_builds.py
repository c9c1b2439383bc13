"""CPU tests of bench/compare_builds.py's shape rules (no GPU, no torch): the GQA sweep's points and
FLOPs, the --heads parser, the defaults per sweep, the table and labels of GQA rows, and the
--window / --softcap / --varlen arguments."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import compare_builds as cb  # noqa: E402


def test_heads_parser():
    assert cb.parse_heads("32:4,64:8") == [(32, 4), (64, 8)]
    assert cb.parse_heads("8:8") == [(8, 8)]
    for bad in ("32", "32:5", "32:0", "a:4", "32:4,"):
        with pytest.raises(ValueError):
            cb.parse_heads(bad)


def test_gqa_points_batch_rule_and_flops():
    pts = list(cb.gqa_points([128], [False, True], [2048, 8192, 32768], [(32, 4)], None))
    assert [(p[2], p[3]) for p in pts[:3]] == [(2048, 8), (8192, 4), (32768, 1)]
    for d, causal, s, b, h, hkv, flops in pts:
        assert (h, hkv) == (32, 4)
        assert flops == 4 * b * h * s * s * d / (2 if causal else 1)
    explicit = list(cb.gqa_points([128], [False], [4096], [(64, 8)], [1, 2], factor=2.5))
    assert [(p[3], p[6]) for p in explicit] == [(1, 2.5 * 4 * 64 * 4096 ** 2 * 128), (2, 2.5 * 8 * 64 * 4096 ** 2 * 128)]


def test_defaults_per_sweep():
    paper = cb.parse_args(["--build", "x=python:lib.so"])
    assert (paper.hdims, paper.seqlens, paper.gqa) == ([64, 128, 256], [512, 1024, 2048, 4096, 8192, 16384], False)
    gqa = cb.parse_args(["--build", "x=python:lib.so", "--gqa", "--heads", "16:2"])
    assert (gqa.hdims, gqa.seqlens, gqa.heads) == ([128], [2048, 8192, 32768], [(16, 2)])
    with pytest.raises(SystemExit):
        cb.parse_args(["--build", "x=python:lib.so", "--gqa", "--heads", "16:3"])
    with pytest.raises(SystemExit):
        cb.parse_args(["--build", "x=python:lib.so", "--fp8"])  # FP8 is forward-only


def test_gqa_rows_in_labels_and_table():
    meta = {"pass": "fwd", "hdim": 128, "causal": True, "seqlen": 8192, "batch": 4, "nheads": 64, "nheads_kv": 8,
            "flops": 4.4e12}
    row = cb.point_row(meta, {"x": [2.0, 2.1, 2.2], "fa3": [2.2, 2.2, 2.2]}, ["x"], True, False)
    assert cb.point_label(row) == "fwd d128 causal s8192 b4 h64:8"
    lines = cb.table_lines([row], ["x"], True, False)
    assert "batch" in lines[0] and "heads" in lines[0]
    assert "    4  64:8 |" in lines[2]
    assert row["ratios"]["x/fa3"]["median"] == pytest.approx(2.2 / 2.1)
    paper = dict(meta, nheads=16, nheads_kv=16)
    assert cb.point_label(paper) == "fwd d128 causal s8192"


def test_window_and_softcap_arguments():
    """--window / --softcap: flash3's window_size and FA3's window_size_left/right (right 0 when
    causal, -1 otherwise), softcap under the same name; none without them; not with --fp8."""
    assert cb.mask_kwargs(-1, 0.0, True, False) == {}
    assert cb.mask_kwargs(-1, 0.0, True, True) == {}
    assert cb.mask_kwargs(4096, 0.0, True, False) == {"window_size": (4096, 0)}
    assert cb.mask_kwargs(4096, 0.0, False, False) == {"window_size": (4096, -1)}
    assert cb.mask_kwargs(1024, 30.0, True, True) == {"window_size_left": 1024, "window_size_right": 0, "softcap": 30.0}
    assert cb.mask_kwargs(-1, 30.0, False, True) == {"softcap": 30.0}
    a = cb.parse_args(["--build", "x=python:lib.so", "--window", "4096", "--softcap", "30"])
    assert (a.window, a.softcap) == (4096, 30.0)
    with pytest.raises(SystemExit):
        cb.parse_args(["--build", "x=python:lib.so", "--fp8", "--pass", "fwd", "--window", "128"])


def test_varlen_argument():
    """--varlen: off by default, on with the flag, and not with --fp8."""
    assert not cb.parse_args(["--build", "x=python:lib.so"]).varlen
    assert cb.parse_args(["--build", "x=python:lib.so", "--varlen", "--pass", "bwd"]).varlen
    with pytest.raises(SystemExit):
        cb.parse_args(["--build", "x=python:lib.so", "--fp8", "--pass", "fwd", "--varlen"])


def test_docs_argument():
    """--docs: document lengths for --varlen calls only; the lengths fill the tokens exactly."""
    docs = cb.parse_args(["--build", "x=python:lib.so", "--varlen", "--docs"])
    assert docs.varlen is True and docs.docs is True
    equal = cb.parse_args(["--build", "x=python:lib.so", "--varlen"])
    assert equal.varlen is True and equal.docs is False
    with pytest.raises(SystemExit):
        cb.parse_args(["--build", "x=python:lib.so", "--docs"])
    lens = cb.doc_lengths(16384)
    assert sum(lens) == 16384 and min(lens) > 0 and max(lens) <= 8192 and len(lens) > 1
