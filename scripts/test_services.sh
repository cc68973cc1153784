#!/usr/bin/env bash
# Installs and starts what the slow tiers need; idempotent. Usage: test_services.sh PYTHON
set -euo pipefail
PY=${1:-python3}
# Build the embedded model folder once, before tests run in parallel.
"$PY" -c "from gateway.models import resolve_model; resolve_model('tiny'); resolve_model('smollm2')"

# Sandboxes (tests marked `docker`, and the local backend's bubblewrap): Docker engine,
# bubblewrap, debootstrap for the offline image build. Needs root (CI runs as root).
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
APT="$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -y -q"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    echo "test_services: installing ${missing[*]}"
    $APT update
    $APT install --no-install-recommends "${missing[@]}"
fi

# A Docker engine without iptables or a bridge: sandboxes use `--network none` only.
if ! docker info >/dev/null 2>&1; then
    echo "test_services: starting dockerd"
    mkdir -p /var/log
    $SUDO sh -c 'nohup dockerd --iptables=false --ip6tables=false --bridge=none >/var/log/dockerd.log 2>&1 &'
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        echo "test_services: dockerd did not come up; last lines of /var/log/dockerd.log:" >&2
        tail -n 30 /var/log/dockerd.log >&2 || true
        exit 1
    fi
fi

# The sandbox base image (offline: debootstrap + python3 + openai/openai-agents); cached by tag.
"$PY" -m sandbox.image build

# Bring your own agent (slow tests, recipes/blackbox_mini_swe.yaml): mini-swe-agent from PyPI,
# unmodified, in a venv of its own (local backend) and in a derived image (docker); both cached.
MINI=mini-swe-agent==2.4.6
MINI_VENV=$("$PY" -c "from gateway.models import loongsage_home; print(loongsage_home() / 'agents' / 'mini-swe-agent')")
if ! "$MINI_VENV/bin/python" -c "import minisweagent" 2>/dev/null; then
    echo "test_services: installing $MINI into $MINI_VENV"
    rm -rf "$MINI_VENV"
    "$PY" -m venv "$MINI_VENV"
    "$MINI_VENV/bin/python" -m pip install -q "$MINI"
fi
"$PY" -m sandbox.image build "packages=[$MINI]" tag=loongsage-mini-swe-agent:latest
