"""A C source built against include/flash3/flash3_c.h into a shared library, for the tests that
read the C header's struct layouts back (test_torch.py, test_kvcache.py)."""
import ctypes
import os
import shutil
import subprocess

import pytest


def build(tmp_path, source):
    """ctypes.CDLL of `source` compiled with the C compiler ($CC, cc, gcc or clang) as C99 against
    include/flash3; skips the test without a compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to read include/flash3/flash3_c.h with")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "probe.c").write_text(source)
    so = tmp_path / "probe.so"
    r = subprocess.run([cc, "-std=c99", "-shared", "-fPIC", "-I", os.path.join(root, "include"),
                        str(tmp_path / "probe.c"), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(so))
