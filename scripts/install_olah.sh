#!/usr/bin/env bash
# Install olah (a real self-hosted HF hub mirror, MIT) into its OWN virtualenv: it pulls its own
# huggingface_hub, which must not touch the project's. The hub tests find it there
# (or $KIMI_QUANT_OLAH_CLI) and skip, with the reason, when it is absent.
#
#   scripts/install_olah.sh [VENV_DIR]      # default: ${XDG_CACHE_HOME:-~/.cache}/kimi-quant/olah-venv
set -euo pipefail
venv="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/kimi-quant/olah-venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/olah-cli" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "olah>=0.5,<0.6"
fi
"$venv/bin/olah-cli" --help >/dev/null
echo "olah installed: $venv/bin/olah-cli (tests look there; for another VENV_DIR export KIMI_QUANT_OLAH_CLI=$venv/bin/olah-cli)"
