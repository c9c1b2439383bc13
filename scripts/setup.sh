#!/usr/bin/env bash
# Installs what flash3 needs to build and test:
#   - CUTLASS/CuTe headers from the PyPI wheel nvidia-cutlass==4.2.0.0 into third_party/cutlass
#   - GoogleTest from Debian (libgtest-dev)
# CCCL comes with the CUDA toolkit. Safe to run again: it skips what is already there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUTLASS_VERSION=4.2.0.0
dest="$root/third_party/cutlass"

if [ ! -f "$dest/include/cute/tensor.hpp" ] || [ "$(cat "$dest/VERSION" 2>/dev/null)" != "$CUTLASS_VERSION" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps "nvidia-cutlass==$CUTLASS_VERSION" -d "$tmp"
  rm -rf "$dest" && mkdir -p "$dest"
  python3 - "$tmp" "$dest" <<'PY'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "nvidia_cutlass-*.whl"))[0]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(dest, "include", name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                dst.write(src.read())
PY
  echo "$CUTLASS_VERSION" > "$dest/VERSION"
  rm -rf "$tmp"
  echo "setup: CUTLASS $CUTLASS_VERSION headers in $dest/include"
fi

if { [ ! -f /usr/include/gtest/gtest.h ] || [ ! -f /usr/src/googletest/CMakeLists.txt ]; } &&
   [ ! -f "$root/third_party/googletest/CMakeLists.txt" ] && [ "${FLASH3_SKIP_APT:-0}" != 1 ]; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev googletest cmake ninja-build >/dev/null
  else
    echo "setup: GoogleTest not found and no apt-get; tests will not be built" >&2
  fi
fi
# GoogleTest is built from the Debian package's sources (copied so that the same tree
# builds on machines without the package, e.g. the GPU machine, which has no network).
if [ ! -f "$root/third_party/googletest/CMakeLists.txt" ] && [ -f /usr/src/googletest/CMakeLists.txt ]; then
  mkdir -p "$root/third_party" && cp -r /usr/src/googletest "$root/third_party/googletest"
fi
command -v nvcc >/dev/null || { echo "setup: nvcc (CUDA 12.4+) must be on PATH" >&2; exit 1; }
echo "setup: done"
