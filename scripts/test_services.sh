#!/usr/bin/env bash
# Installs and starts what the slow tiers need; idempotent. Usage: test_services.sh PYTHON
set -euo pipefail
PY=${1:-python3}
# Build the embedded model folder once, before tests run in parallel.
"$PY" -c "from gateway.models import resolve_model; resolve_model('tiny'); resolve_model('smollm2')"
