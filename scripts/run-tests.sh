#!/usr/bin/env bash
# `make test`: installs what the tests need, then runs every suite, each even when an earlier one
# fails (the exit status is non-zero if any did). Everything that installs starts at once, so that
# no core waits: the system packages, the main venv, and, niced, the IPEX venv (torch 2.8's CUDA
# wheels: about 7 GB to fetch and unpack), which takes the core the main venv's pip leaves idle and
# then whatever the main suite leaves. (It used to start with the main suite: on a fresh machine it
# then competed with it for both cores, and the IPEX suite could wait for it at the end.)
# SKIP_IPEX=1 leaves the IPEX suite out (locally).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
logs=$(mktemp -d)
background=()
# On an early exit nothing installs on behind our back (each script's children first: pip, apt).
stop_background() {
    for pid in "${background[@]}"; do pkill -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done
    rm -rf "$logs"
}
trap stop_background EXIT

scripts/install-test-deps.sh >"$logs/deps" 2>&1 &
deps=$!
background+=("$deps")
if [ "${SKIP_IPEX:-}" != 1 ]; then
    # the IPEX venv, then its suite, both niced: they take what the main suite leaves of the cores (its
    # tests wait on Slurm, Ray and SSH at times), and are done when it is; the solo tests wait for them
    (
        nice -n 19 scripts/ipex-venv.sh >"$logs/ipex" 2>&1 || { echo build >"$logs/ipex-failed"; exit 1; }
        nice -n 19 scripts/test-ipex.sh >"$logs/ipex-tests" 2>&1 || { echo tests >"$logs/ipex-failed"; exit 1; }
    ) &
    ipex=$!
    background+=("$ipex")
fi
make --no-print-directory venv || { wait "$deps"; exit 1; }
wait "$deps" || { cat "$logs/deps" >&2; echo "error: installing the tests' system packages failed" >&2; exit 1; }
cat "$logs/deps"

failed=""
# Two workers: a test waiting on Slurm, Ray, SSH or a signal leaves a core idle that the other worker's
# test takes (docs/architecture.md, "Conventions", on tests). The `solo` tests need the machine alone: after.
HF_HUB_OFFLINE=1 "$BIN/python" -m pytest -q -ra --durations=10 -n 2 --dist loadgroup -m "not solo" \
    || failed="$failed main(tests/)"
if [ "${SKIP_IPEX:-}" = 1 ]; then
    echo "SKIP_IPEX=1: not running make test-ipex"
elif wait "$ipex"; then
    cat "$logs/ipex" "$logs/ipex-tests"
else
    if [ "$(cat "$logs/ipex-failed" 2>/dev/null)" = tests ]; then
        cat "$logs/ipex" "$logs/ipex-tests" >&2
        failed="$failed ipex(tests/ipex, .venv-ipex)"
    else
        cat "$logs/ipex" >&2
        failed="$failed ipex(building .venv-ipex)"
    fi
fi
HF_HUB_OFFLINE=1 "$BIN/python" -m pytest -q -ra -m solo || failed="$failed main-solo(tests/)"
if [ -n "$failed" ]; then
    echo "make test: FAILED suites:$failed" >&2
    exit 1
fi
