#!/usr/bin/env bash
# Prepare one cluster node for xeontune; run over SSH by `xeontune cluster up` (xeontune/cluster/bootstrap.py).
#
#   bootstrap-node.sh --root DIR --wheel FILE [--work-dir DIR] [--user USER] [--offline]
#                     [--torch-index URL] [--make-cluster-key FILE] [--authorize-key LINE]
#                     [--client-alive DIR]
#
# --root DIR            every node gets the same absolute paths: DIR/venv, DIR/work (Hydra needs that)
# --wheel FILE          the project's wheel, built on the caller's machine and copied here
# --offline             no package index: a venv that sees the system's site-packages, the wheel
#                       installed without dependencies (the local namespace hosts in the tests)
# --torch-index URL     where torch comes from (default: the CPU-only PyTorch index, not the CUDA build)
# --make-cluster-key F  generate an ed25519 key at F on this node (the head's key for head -> worker ssh)
# --authorize-key LINE  append LINE to this user's ~/.ssh/authorized_keys (once)
# --client-alive DIR    sshd drops a client that stopped answering within 2 min: DIR/60-xeontune.conf
#                       (DIR: the sshd_config.d that sshd includes, /etc/ssh/sshd_config.d on cloud nodes)
#
# Idempotent, and safe when several "nodes" share one filesystem (a lock serialises them).
set -euo pipefail

root="" wheel="" work="" user="$(id -un)" offline=0
torch_index="https://download.pytorch.org/whl/cpu"
torch_version="2.13.0"
make_key="" authorize="" client_alive=""
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root="$2"; shift 2 ;;
        --wheel) wheel="$2"; shift 2 ;;
        --work-dir) work="$2"; shift 2 ;;
        --user) user="$2"; shift 2 ;;
        --offline) offline=1; shift ;;
        --torch-index) torch_index="$2"; shift 2 ;;
        --make-cluster-key) make_key="$2"; shift 2 ;;
        --authorize-key) authorize="$2"; shift 2 ;;
        --client-alive) client_alive="$2"; shift 2 ;;
        *) echo "bootstrap-node.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
[ -n "$root" ] || { echo "bootstrap-node.sh: --root is required" >&2; exit 2; }
case "$root" in /*) ;; *) echo "bootstrap-node.sh: --root must be absolute" >&2; exit 2 ;; esac
work="${work:-$root/work}"

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"

if [ ! -d "$root" ] || [ ! -w "$root" ]; then
    $SUDO mkdir -p "$root"
    $SUDO chown "$user" "$root"
fi
mkdir -p "$work"

# Nodes that share a filesystem (the local provider's namespaces) take turns from here on.
exec 9>"$root/.bootstrap.lock"
flock 9

if [ -n "$authorize" ]; then
    # Over SSH, HOME is the login user's home; for another --user ask the passwd database.
    if [ "$user" = "$(id -un)" ] && [ -n "${HOME:-}" ]; then home="$HOME"; else home="$(getent passwd "$user" | cut -d: -f6)"; fi
    mkdir -p "$home/.ssh"
    chmod 700 "$home/.ssh"
    touch "$home/.ssh/authorized_keys"
    chmod 600 "$home/.ssh/authorized_keys"
    grep -qxF -- "$authorize" "$home/.ssh/authorized_keys" || printf '%s\n' "$authorize" >>"$home/.ssh/authorized_keys"
fi

if [ -n "$client_alive" ]; then
    # A laptop that vanished leaves a half-open SSH connection, which sshd keeps (and autostop counts
    # as a session) for about 2 h without keepalives: probe every 30 s, drop it after 4 unanswered.
    $SUDO mkdir -p "$client_alive"
    printf 'ClientAliveInterval 30\nClientAliveCountMax 4\n' | $SUDO tee "$client_alive/60-xeontune.conf" >/dev/null
    if [ "$client_alive" = /etc/ssh/sshd_config.d ]; then  # the system's sshd (a test's own DIR: nothing to reload)
        # new logins get it (the reload keeps open sessions, this one included)
        $SUDO systemctl reload ssh 2>/dev/null || $SUDO systemctl reload sshd 2>/dev/null || true
        sshd_bin="$(command -v sshd || echo /usr/sbin/sshd)"
        if [ -x "$sshd_bin" ]; then  # an image whose sshd_config sets it before its Include wins: say so
            shown="$($SUDO "$sshd_bin" -T 2>/dev/null | grep -i '^clientaliveinterval ' || true)"
            [ "$shown" = "clientaliveinterval 30" ] \
                || echo "bootstrap-node.sh: warning: sshd does not apply $client_alive/60-xeontune.conf (${shown:-nothing shown})" >&2
        fi
    fi
fi

if [ -n "$make_key" ]; then
    mkdir -p "$(dirname "$make_key")"
    chmod 700 "$(dirname "$make_key")"
    [ -f "$make_key" ] || ssh-keygen -q -t ed25519 -N "" -C "xeontune-head" -f "$make_key"
    cat "$make_key.pub"
fi

[ -n "$wheel" ] || exit 0
[ -f "$wheel" ] || { echo "bootstrap-node.sh: no wheel at $wheel" >&2; exit 2; }

venv="$root/venv"
if [ "$offline" -eq 1 ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install --quiet --no-index --no-deps --force-reinstall "$wheel"
else
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c "import ensurepip" >/dev/null 2>&1; then
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    # tcmalloc makes the training step about 20% faster; the package name differs by release.
    if ! ldconfig -p | grep -q libtcmalloc; then
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgoogle-perftools4t64 >/dev/null 2>&1 \
            || $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgoogle-perftools4 >/dev/null 2>&1 || true
    fi
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # torch first, from the CPU index: PyPI's default build is the multi-GB CUDA one.
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" --index-url "$torch_index"
    "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
    "$venv/bin/python" -m pip install --quiet "$wheel"
fi
"$venv/bin/python" -c "import sys, xeontune; print('xeontune', xeontune.__version__, 'in', sys.prefix)"
