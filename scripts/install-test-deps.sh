#!/usr/bin/env bash
# System packages the tests use: sshd and iproute2 for the network-namespace cluster, tcmalloc
# (libgoogle-perftools4) for the allocator detection and preload, Slurm (slurm-wlm: slurmctld, slurmd
# and the client commands; the tests run them without munge) for the Slurm tests, and a C++ compiler (g++)
# for xeontune's attention kernel, which torch's extension builder compiles on first use.
# Installed only when running as root (CI does); otherwise we say what is missing.
set -euo pipefail
PKGS=(openssh-server openssh-client iproute2 procps libgoogle-perftools4 slurm-wlm g++)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    echo "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "note: missing system packages (${missing[*]}); the cluster tests that need them will be skipped" >&2
fi
