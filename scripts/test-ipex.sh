#!/usr/bin/env bash
# Runs tests/ipex/ in the IPEX venv (built or reused by scripts/ipex-venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${IPEX_VENV:-.venv-ipex}
scripts/ipex-venv.sh
# IPEX must import here; if it does not, say why in one place rather than fail every test alike.
if ! out=$("$VENV/bin/python" -c "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)" 2>&1); then
    echo "$out" | tail -n 5 >&2
    echo "error: intel_extension_for_pytorch does not import in $VENV (above); tests/ipex not run" >&2
    exit 1
fi
echo "$out" | tail -n 1
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider tests/ipex "$@"
