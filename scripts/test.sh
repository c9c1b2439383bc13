#!/usr/bin/env bash
# Set up, build, install the Python package (scripts/build.sh: pip install . into build/venv) and
# run every test: GoogleTest through CTest, then, where PyTorch and pytest are importable, the
# installed package imported from outside the checkout and the Python tests. GPU tests report
# themselves as skipped without a Hopper GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j"$(nproc)"
py="$root/build/venv/bin/python"
[ -x "$py" ] || py=python3
if "$py" -c "import torch, pytest" 2>/dev/null; then
  if "$py" -c "import importlib.util as u, sys; s = u.find_spec('flash3'); sys.exit(s is None)" 2>/dev/null; then
    # No FLASH3_LIB, no PYTHONPATH: the library must come from the package.
    (cd / && env -u FLASH3_LIB -u PYTHONPATH "$py" -c \
      "import flash3, os; print('installed flash3', flash3.version(), 'in', os.path.dirname(flash3.__file__))")
  fi
  "$py" -m pytest -q "$root/tests"
fi
