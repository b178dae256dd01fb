#!/usr/bin/env bash
# Builds (or reuses) a venv with the last IPEX release (2.8.0) and the torch it needs (2.8.0):
# `make venv-ipex` for users who want IPEX's faster bf16 kernels on AVX-512/AMX Xeons, and the venv
# `make test-ipex` runs tests/ipex/ in. That torch on PyPI is the CUDA build, so the venv takes about
# 7 GB of disk and a few minutes to install; it is rebuilt only when this script or pyproject.toml
# changes. The project itself is installed --no-deps because its pyproject pins the torch 2.13 CPU
# build (so no pip "extra" can hold IPEX: its pins would conflict).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${IPEX_VENV:-.venv-ipex}
TORCH_VERSION=2.8.0
IPEX_VERSION=2.8.0
# Same lower bounds as pyproject.toml; everything the trainer imports (peft for --method lora), minus
# torch. IPEX is archived and will not follow transformers: 5.24 removed
# transformers.modeling_attn_mask_utils, which `import intel_extension_for_pytorch` needs (NameError at
# import), so transformers stays below it.
DEPS=(
    "diffusers>=0.35" "transformers>=4.50,<5.24" "accelerate>=1.10" "peft>=0.17" "safetensors>=0.4"
    "huggingface_hub>=0.30" numpy pillow pyyaml tqdm psutil "pytest>=8" pytest-timeout
)

stamp="$VENV/.xeontune-ipex-stamp"
want=$(cat "$0" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    start=$(date +%s)
    echo "building $VENV (torch $TORCH_VERSION + IPEX $IPEX_VERSION, about 7 GB, a few minutes)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    log="$VENV/install.log"
    # Chained with &&: `set -e` does not apply inside a group followed by ||, so a failed step would
    # otherwise be passed over (seen once: a full disk failed torch's install, and "built" was printed).
    {
        "$VENV/bin/python" -m pip install --upgrade pip &&
        # --no-cache-dir: the CUDA wheels would otherwise take the same space again in the pip cache.
        "$VENV/bin/python" -m pip install --no-cache-dir \
            "torch==$TORCH_VERSION" "intel-extension-for-pytorch==$IPEX_VERSION" "${DEPS[@]}" &&
        # `make test` builds the main venv meanwhile: its editable install writes the same build/ and
        # xeontune.egg-info here, so the two take turns (the Makefile's lock).
        $(command -v flock >/dev/null && echo flock pyproject.toml) \
            "$VENV/bin/python" -m pip install --no-cache-dir --no-deps -e .
    } > "$log" 2>&1 || { tail -n 30 "$log" >&2; echo "error: building $VENV failed (log: $log)" >&2; exit 1; }
    echo "$want" > "$stamp"
    echo "built $VENV in $(( $(date +%s) - start )) s"
fi

