#!/usr/bin/env bash
# The user install's footprint: a fresh venv with the package alone (no extras, no torch), then
# `kimi-quant demo` in it. Prints the installed size and the demo's last lines. Usage: bash scripts/bench_install.sh [VENV_DIR]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$(mktemp -d)/venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q "$repo" 2>&1 | grep -v "^WARNING: Location" || true
size_mb=$(du -sm "$venv" | cut -f1)
demo="$(dirname "$venv")/demo"
(cd "$(dirname "$venv")" && "$venv/bin/kimi-quant" demo --output "$demo" | tail -3)
echo "user install (no extras, no torch): ${size_mb} MB in $venv ($(date -u +%F), $(python3 --version))"
"$venv/bin/python" -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch got installed'"
