#!/usr/bin/env bash
# `make test`: installs what the tests need, then runs every suite, each even when an earlier one
# fails (the exit status is non-zero if any did). Two waits overlap work that would otherwise add
# minutes on a fresh machine: the system packages install while the main venv builds, and the IPEX
# venv (torch 2.8's CUDA wheels: about 7 GB to fetch and unpack) builds, niced, while the main suite
# runs. SKIP_IPEX=1 leaves the IPEX suite out (locally).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

scripts/install-test-deps.sh >"$logs/deps" 2>&1 &
deps=$!
make --no-print-directory venv || { wait "$deps"; exit 1; }
wait "$deps" || { cat "$logs/deps" >&2; echo "error: installing the tests' system packages failed" >&2; exit 1; }
cat "$logs/deps"

if [ "${SKIP_IPEX:-}" != 1 ]; then
    nice -n 19 scripts/ipex-venv.sh >"$logs/ipex" 2>&1 &
    ipex=$!
fi
failed=""
# Two workers: a test waiting on Slurm, Ray, SSH or a signal leaves a core idle that the other worker's
# test takes (docs/architecture.md, "Tests"). The `solo` tests need the machine to themselves: after.
HF_HUB_OFFLINE=1 "$BIN/python" -m pytest -q -ra --durations=10 -n 2 --dist loadgroup -m "not solo" \
    || failed="$failed main(tests/)"
HF_HUB_OFFLINE=1 "$BIN/python" -m pytest -q -ra -m solo || failed="$failed main-solo(tests/)"
if [ "${SKIP_IPEX:-}" = 1 ]; then
    echo "SKIP_IPEX=1: not running make test-ipex"
elif wait "$ipex"; then
    cat "$logs/ipex"
    scripts/test-ipex.sh || failed="$failed ipex(tests/ipex, .venv-ipex)"
else
    cat "$logs/ipex" >&2
    failed="$failed ipex(building .venv-ipex)"
fi
if [ -n "$failed" ]; then
    echo "make test: FAILED suites:$failed" >&2
    exit 1
fi
