"""CPU tests of bench/timing.py's round robin (no GPU, no torch): a stand-in torch records the
order in which the round robin launches things, so the tests see each timed call come after its
before() (e.g. bench_decode's L2 flush) and the spin, the order rotate, and a failing call drop."""
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import timing  # noqa: E402


def stand_in_torch(log):
    """A torch whose CUDA events and spin kernel append to `log`; each event pair times 1 ms."""
    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            log.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    cuda = types.SimpleNamespace(Event=Event, _sleep=lambda cycles: log.append("spin"))
    return types.SimpleNamespace(cuda=cuda)


def test_each_timed_call_follows_before_and_the_spin():
    log = []
    torch = stand_in_torch(log)
    calls = {"a": lambda: log.append("a"), "b": lambda: log.append("b")}
    times = timing.round_robin(torch, calls, 1, 2, 100, {}, before=lambda: log.append("flush"))
    assert times == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert log[:2] == ["a", "b"]  # the warm-up calls: no flush, no spin, not timed
    timed = log[2:]
    one = lambda name: ["flush", "spin", "record", name, "record"]  # noqa: E731
    assert timed == one("a") + one("b") + one("b") + one("a")  # the order rotates by one


def test_without_before_nothing_runs_ahead_of_the_spin():
    log = []
    timing.time_call_ms(stand_in_torch(log), lambda: log.append("x"), 100)
    assert log == ["spin", "record", "x", "record"]
    log.clear()
    timing.time_call_ms(stand_in_torch(log), lambda: log.append("x"), 0, before=lambda: log.append("flush"))
    assert log == ["flush", "record", "x", "record"]


def test_a_failing_call_is_dropped_with_its_error():
    log = []

    def bad():
        raise RuntimeError("no kernel for this shape\nsecond line")

    errors = {}
    times = timing.round_robin(stand_in_torch(log), {"ok": lambda: None, "bad": bad}, 0, 3, 0, errors,
                               before=lambda: None)
    assert list(times) == ["ok"] and len(times["ok"]) == 3
    assert errors == {"bad": "RuntimeError: no kernel for this shape"}


def test_bench_decode_flushes_by_default():
    import bench_decode
    assert bench_decode.parse_args([]).l2 == "cold"
    assert bench_decode.parse_args(["--l2", "shared"]).l2 == "shared"
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--l2", "warm"])  # only cold or shared
