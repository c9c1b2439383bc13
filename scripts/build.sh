#!/usr/bin/env bash
# Set up the dependencies (scripts/setup.sh), build flash3 into build/ with every core, and install
# the Python package with `pip install .` into the virtual environment build/venv.
#
# build/venv sees the packages of the Python that made it (PyTorch and pytest are not installed
# again): --system-site-packages, and, for a Python that is itself a virtual environment (whose
# packages --system-site-packages would not show), a .pth file naming its site-packages. pip builds through scikit-build-core in build/, the CMake tree
# a plain `cmake --build build` uses, with the tests and the benchmark on; --no-build-isolation
# keeps the CMake cache from one run to the next (with build isolation scikit-build-core starts
# it over, since its own path changes), so only what changed recompiles and the install reuses
# the objects. Without scikit-build-core (no network), it builds with CMake alone and the binding
# is used from the checkout (python/ finds build/libflash3.so).
#   FLASH3_PYTHON=python3.12 bash scripts/build.sh   the Python the venv is made from
#   CMAKE_BUILD_PARALLEL_LEVEL=N                     compile jobs (default: every core)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
venv="$root/build/venv"
if [ ! -x "$venv/bin/python" ]; then
  py="${FLASH3_PYTHON:-python3}"
  mkdir -p build && "$py" -m venv --system-site-packages "$venv"
  "$py" -c "import site; print('\n'.join(site.getsitepackages()))" > \
    "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_flash3_parent_env.pth"
fi
have_skbuild() { "$venv/bin/python" -c "import scikit_build_core" 2>/dev/null; }
have_skbuild || "$venv/bin/python" -m pip install -q "scikit-build-core>=0.11" || true
start=$(date +%s)
if have_skbuild; then
  "$venv/bin/python" -m pip install -v --no-build-isolation --no-deps \
    -C build-dir=build -C cmake.define.FLASH3_BUILD_TESTS=ON -C cmake.define.FLASH3_BUILD_BENCH=ON .
  echo "build: pip install . into $venv ($("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'))"
else
  echo "build: scikit-build-core not available: CMake only, the Python package is not installed" >&2
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  [ -f build/CMakeCache.txt ] || cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
  cmake --build build
fi
echo "build: $(( $(date +%s) - start )) s with $CMAKE_BUILD_PARALLEL_LEVEL jobs on $(nproc) cores"
