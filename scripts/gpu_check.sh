#!/usr/bin/env bash
# End to end on ONE GPU: SGLang generates, Megatron trains, the weights go back to SGLang after
# every step. Prints, per step and in summary: step time, weight-sync time and GB/s, and the
# train-inference gap; then runs the GPU tier of the Megatron tests; then multi-teacher on-policy
# distillation (recipes/gpu/qwen3_opd_multi_teacher.yaml cut to one GPU: the same model as
# student and as two SGLang teachers with --enable-memory-saver --enable-weights-cpu-backup,
# a budget that holds one, 2 steps): teacher swaps (release/resume), scoring tokens/s,
# distill/reverse_kl, and the GPU memory used (nvidia-smi, sampled) while it runs.
#
#   bash scripts/gpu_check.sh                     # Qwen/Qwen3-0.6B, 4 steps
#   MODEL=/path/to/hf-folder STEPS=6 bash scripts/gpu_check.sh
#
# Needs a CUDA GPU and network access for the first run (SGLang into .venv-sglang, which pins
# its own CUDA torch; megatron-core into the project's .venv; the model from the HF Hub). The run
# itself (recipes/gpu/qwen3_colocated.yaml cut to one GPU: Megatron TP 1 and one SGLang server
# keeping 40% of the GPU) takes a few minutes; the script stops it at RUN_TIMEOUT seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen3-0.6B}
STEPS=${STEPS:-4}
PORT=${PORT:-30000}
RUN_TIMEOUT=${RUN_TIMEOUT:-540}
SGLANG_SPEC=${SGLANG_SPEC:-sglang>=0.5.2}
SGL_VENV=${SGL_VENV:-.venv-sglang}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/loongsage-gpu-check}
mkdir -p "$OUT"

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "needs a CUDA GPU (nvidia-smi)"; exit 1; }
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

if [ ! -x "$PY" ]; then make setup; fi
"$PY" -m pip install -q -e '.[megatron]'
"$PY" -c "import torch, megatron.core as m; assert torch.cuda.is_available(), 'CPU torch'; \
print('torch', torch.__version__, 'megatron-core', m.__version__)"
if [ ! -x "$SGL_VENV/bin/python" ]; then python3 -m venv "$SGL_VENV"; fi
"$SGL_VENV/bin/python" -m pip install -q --upgrade pip
"$SGL_VENV/bin/python" -m pip install -q "$SGLANG_SPEC"

if [ -d "$MODEL" ]; then
  MODEL_DIR=$(cd "$MODEL" && pwd)
else
  MODEL_DIR=$("$SGL_VENV/bin/python" -c \
    "from huggingface_hub import snapshot_download; print(snapshot_download('$MODEL'))")
fi
echo "model: $MODEL_DIR"

SGL_PID=
TEACHER_PIDS=()
cleanup() {
  for pid in $SGL_PID "${TEACHER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
"$SGL_VENV/bin/python" -m sglang.launch_server --model-path "$MODEL_DIR" --host 127.0.0.1 \
  --port "$PORT" --mem-fraction-static 0.4 --weight-version 0 --log-level warning \
  >"$OUT/sglang.log" 2>&1 &
SGL_PID=$!
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$SGL_PID" 2>/dev/null || { echo "SGLang died; see $OUT/sglang.log"; exit 1; }
  sleep 1
done

RUN="$OUT/run-$(date +%Y%m%d-%H%M%S)"
start=$(date +%s)
timeout "$RUN_TIMEOUT" "$PY" -m trainer.run recipe=gpu/qwen3_colocated \
  model.name="$MODEL_DIR" "engine.urls=[http://127.0.0.1:$PORT]" \
  train.tensor_parallel=1 train.data_parallel=1 train.micro_batch_tokens=8192 \
  train.gradient_checkpointing=false \
  rollout.batch_size=8 rollout.max_tokens=512 rollout.max_turns=3 \
  run.steps="$STEPS" run.checkpoint_every=0 eval.every=0 eval.n=16 \
  ray.num_cpus=8 ray.trainer_strategy=PACK run.dir="$RUN" logging.progress=false
echo "run: $(( $(date +%s) - start )) s wall, in $RUN"

"$PY" - "$RUN/metrics.jsonl" "$GPU_NAME" "$MODEL_DIR" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in rows if r["step"] > 0]
print(f"\n{sys.argv[2]}, {sys.argv[3]}, {len(steps)} steps")
print("step  step_s  train_s  sync_s  GB/s   GB    |logp gap|  k3_kl")
prev = next((r["time_s"] for r in rows if r["step"] == 0), 0.0)
step_s = []
for r in steps:
    step_s.append(r["time_s"] - prev)
    prev = r["time_s"]
    print(f"{r['step']:>4}  {step_s[-1]:6.1f}  {r['time/train_s']:7.2f}  "
          f"{r['time/weight_sync_s']:6.2f}  {r.get('weights/gb_per_s', 0):5.2f}  "
          f"{r.get('weights/bytes', 0) / 1e9:4.2f}  {r['mismatch/logprob_abs_diff']:9.2e}  "
          f"{r['mismatch/k3_kl']:.2e}")
med = statistics.median
print(f"median: step {med(step_s):.1f} s, train {med(r['time/train_s'] for r in steps):.2f} s, "
      f"weight sync {med(r['time/weight_sync_s'] for r in steps):.2f} s at "
      f"{med(r.get('weights/gb_per_s', 0) for r in steps):.2f} GB/s; train-inference gap "
      f"{statistics.mean(r['mismatch/logprob_abs_diff'] for r in steps):.2e} (mean |logp diff|)")
EOF

echo "=== GPU tier of the Megatron tests ==="
"$PY" -m pytest tests/test_megatron.py -m gpu -q -p no:cacheprovider -rs

echo "=== Multi-teacher on-policy distillation: two SGLang teachers, a budget that holds one ==="
for port in 30010 30011; do
  "$SGL_VENV/bin/python" -m sglang.launch_server --model-path "$MODEL_DIR" --host 127.0.0.1 \
    --port "$port" --mem-fraction-static 0.12 --enable-memory-saver --enable-weights-cpu-backup \
    --log-level warning >"$OUT/teacher-$port.log" 2>&1 &
  TEACHER_PIDS+=($!)
done
for port in 30010 30011; do
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
done
OPD="$OUT/opd-$(date +%Y%m%d-%H%M%S)"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$OUT/opd-gpu-mem.txt" &
SMI_PID=$!
timeout "$RUN_TIMEOUT" "$PY" -m trainer.run recipe=gpu/qwen3_opd_multi_teacher \
  model.name="$MODEL_DIR" "engine.urls=[http://127.0.0.1:$PORT]" \
  algorithm.distill.teachers.calc.model="$MODEL_DIR" \
  algorithm.distill.teachers.arith.model="$MODEL_DIR" \
  algorithm.distill.teachers.calc.memory_bytes=17GB \
  algorithm.distill.teachers.arith.memory_bytes=17GB algorithm.distill.memory_budget=20GB \
  train.tensor_parallel=1 train.data_parallel=1 train.micro_batch_tokens=8192 \
  train.gradient_checkpointing=false rollout.batch_size=8 rollout.max_tokens=512 \
  rollout.max_turns=3 run.steps=2 run.checkpoint_every=0 eval.every=0 eval.n=16 \
  ray.num_cpus=8 ray.trainer_strategy=PACK run.dir="$OPD" logging.progress=false || true
kill "$SMI_PID" 2>/dev/null || true
"$PY" - "$OPD/metrics.jsonl" "$OUT/opd-gpu-mem.txt" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in (r for r in rows if r["step"] > 0):
    keys = sorted(k for k in r if k.startswith(("distill/", "teachers/")))
    print(f"step {r['step']}: " + ", ".join(f"{k}={r[k]:.4g}" for k in keys))
mem = [int(x) for x in open(sys.argv[2]).read().split() if x.isdigit()]
print(f"GPU memory used during the run: max {max(mem, default=0)} MiB")
EOF
