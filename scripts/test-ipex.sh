#!/usr/bin/env bash
# Runs tests/ipex/ in the IPEX venv (built or reused by scripts/ipex-venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${IPEX_VENV:-.venv-ipex}
scripts/ipex-venv.sh
"$VENV/bin/python" -c "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)" 2>/dev/null
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider tests/ipex "$@"
