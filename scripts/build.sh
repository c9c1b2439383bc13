#!/usr/bin/env bash
# Set up the dependencies (scripts/setup.sh) and build flash3 into build/ with every core.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
[ -f build/CMakeCache.txt ] || cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
start=$(date +%s)
cmake --build build -j"$(nproc)"
echo "build: $(( $(date +%s) - start )) s on $(nproc) cores"
