#!/usr/bin/env bash
# Run the SGLang client tests (tests/test_sglang.py, tests/test_router.py's protocol is the same)
# against a REAL SGLang server, on a machine with a CUDA GPU and network access.
#
#   bash scripts/gpu_check_sglang.sh                # Qwen/Qwen2.5-0.5B-Instruct
#   MODEL=/path/to/hf-folder bash scripts/gpu_check_sglang.sh
#
# SGLang goes into its own virtualenv (.venv-sglang): it pins a CUDA torch that must not replace
# the project's. Two servers are started, one streaming cumulatively (SGLang's default) and one
# with --incremental-streaming-output, and the same tests run against each with SGLANG_URL set
# (which switches tests/test_sglang.py from the fake server to the real one). SGLANG_MODEL_DIR
# enables the disk weight-update test (it reloads the model's own safetensors as version N+1).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
SGLANG_SPEC=${SGLANG_SPEC:-sglang>=0.5.2}
PORT=${PORT:-30000}
SGL_VENV=${SGL_VENV:-.venv-sglang}
PY=${PY:-.venv/bin/python}
LOG_DIR=${LOG_DIR:-/tmp/loongsage-gpu-check}
mkdir -p "$LOG_DIR"

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "needs a CUDA GPU (nvidia-smi)"; exit 1; }

if [ ! -x "$PY" ]; then make setup; fi
if [ ! -x "$SGL_VENV/bin/python" ]; then python3 -m venv "$SGL_VENV"; fi
"$SGL_VENV/bin/python" -m pip install -q --upgrade pip
"$SGL_VENV/bin/python" -m pip install -q "$SGLANG_SPEC"
"$SGL_VENV/bin/python" -c "import sglang; print('sglang', sglang.__version__)"

if [ -d "$MODEL" ]; then
  MODEL_DIR=$(cd "$MODEL" && pwd)
else
  MODEL_DIR=$("$SGL_VENV/bin/python" -c \
    "from huggingface_hub import snapshot_download; print(snapshot_download('$MODEL'))")
fi
echo "model: $MODEL_DIR"

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

launch() {  # launch PORT LOGNAME [extra server args...]
  local port=$1 name=$2; shift 2
  "$SGL_VENV/bin/python" -m sglang.launch_server \
    --model-path "$MODEL_DIR" --host 127.0.0.1 --port "$port" \
    --weight-version 0 --mem-fraction-static 0.35 --log-level warning "$@" \
    >"$LOG_DIR/$name.log" 2>&1 &
  PIDS+=($!)
}

wait_ready() {  # wait_ready PORT: /health answers 200 once the scheduler has run a request
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null; then return 0; fi
    sleep 1
  done
  echo "SGLang on port $1 did not become healthy; see $LOG_DIR"; exit 1
}

launch "$PORT" cumulative
launch "$((PORT + 1))" incremental --incremental-streaming-output
wait_ready "$PORT"
wait_ready "$((PORT + 1))"

status=0
for port in "$PORT" "$((PORT + 1))"; do
  echo "=== tests/test_sglang.py against http://127.0.0.1:$port ==="
  SGLANG_URL="http://127.0.0.1:$port" SGLANG_MODEL_DIR="$MODEL_DIR" \
    "$PY" -m pytest tests/test_sglang.py -q -p no:cacheprovider -rs || status=1
done
exit $status
