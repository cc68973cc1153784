#!/usr/bin/env bash
# TransferMesh against a REAL SGLang server on a machine with a CUDA GPU (and network access to
# install SGLang and fetch the model): CUDA IPC (`update_weights_from_tensor`, flattened buckets),
# the broadcast group (`init_weights_update_group` + `update_weights_from_distributed`) and the
# disk route, each while a request streams, inside SGLang's begin/end weight-update session;
# prints GB/s per route. See scripts/gpu_check_transfermesh.py for what is checked.
#
#   bash scripts/gpu_check_transfermesh.sh                 # Qwen/Qwen2.5-0.5B-Instruct
#   MODEL=/path/to/hf-folder bash scripts/gpu_check_transfermesh.sh
#
# One GPU: the server and the "trainer" (this check) share it; CUDA IPC runs as in a colocated
# setup, and the broadcast group runs over gloo with GPU tensors, because NCCL refuses two ranks
# on one device. Two or more GPUs: the broadcast group runs over NCCL, the trainer on GPU 1.
# SGLang lives in its own virtualenv (.venv-sglang, as in gpu_check_sglang.sh); the check runs
# there with this repository on PYTHONPATH, since CUDA IPC needs SGLang's serializer in the
# sending process.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
SGLANG_SPEC=${SGLANG_SPEC:-sglang>=0.5.2}
PORT=${PORT:-30100}
SGL_VENV=${SGL_VENV:-.venv-sglang}
LOG_DIR=${LOG_DIR:-/tmp/loongsage-gpu-check}
mkdir -p "$LOG_DIR"

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "needs a CUDA GPU (nvidia-smi)"; exit 1; }
GPUS=$(nvidia-smi -L | wc -l)

if [ ! -x "$SGL_VENV/bin/python" ]; then python3 -m venv "$SGL_VENV"; fi
"$SGL_VENV/bin/python" -m pip install -q --upgrade pip
"$SGL_VENV/bin/python" -m pip install -q "$SGLANG_SPEC"
"$SGL_VENV/bin/python" -c "import sglang; print('sglang', sglang.__version__)"
SGL_PY="$SGL_VENV/bin/python"

if [ -d "$MODEL" ]; then
  MODEL_DIR=$(cd "$MODEL" && pwd)
else
  MODEL_DIR=$("$SGL_PY" -c \
    "from huggingface_hub import snapshot_download; print(snapshot_download('$MODEL'))")
fi
echo "model: $MODEL_DIR"

SERVER_PID=""
cleanup() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait || true; fi; }
trap cleanup EXIT

CUDA_VISIBLE_DEVICES=0 "$SGL_PY" -m sglang.launch_server \
  --model-path "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --weight-version 0 \
  --mem-fraction-static 0.35 --incremental-streaming-output --log-level warning \
  >"$LOG_DIR/transfermesh-server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 600); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "SGLang exited; see $LOG_DIR/transfermesh-server.log"; exit 1
  fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "SGLang did not become healthy"; exit 1; }

URL="http://127.0.0.1:$PORT"
status=0
echo "=== CUDA IPC and disk: the trainer on the server's GPU ==="
CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$PWD" "$SGL_PY" scripts/gpu_check_transfermesh.py \
  "$URL" "$MODEL_DIR" cuda_ipc disk || status=1
if [ "$GPUS" -ge 2 ]; then
  echo "=== broadcast over NCCL: the trainer on GPU 1 ==="
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH="$PWD" "$SGL_PY" scripts/gpu_check_transfermesh.py \
    "$URL" "$MODEL_DIR" broadcast || status=1
else
  echo "=== broadcast over gloo (one GPU: NCCL refuses two ranks on one device) ==="
  CUDA_VISIBLE_DEVICES=0 TRANSFER_BACKEND=gloo PYTHONPATH="$PWD" "$SGL_PY" \
    scripts/gpu_check_transfermesh.py "$URL" "$MODEL_DIR" broadcast || status=1
fi
exit $status
