#!/usr/bin/env bash
# GPU smoke check: the paths CPU tests cannot reach (cuda:LOCAL_RANK, NCCL, GPU autocast).
# Trains single, dp, ddp, fsdp, zero2 and zero3 at world size 1 in bf16 and writes each metrics.json
# to OUT_DIR. No network needed; missing deepspeed/fairscale/wandb/einops come from --wheels DIR.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [--wheels DIR] [--steps N]
#
# Budget: under 10 minutes on one GPU (each run is ~40 steps of crnn_mobilenet_v3_small; the benchmark,
# 5 short vitstr_small jobs, is capped at 4 minutes; the trainer-overhead pairs at 3.5, the convergence
# check at 3.3).
set -uo pipefail

OUT_DIR=${1:?usage: gpu_check.sh OUT_DIR [--wheels DIR] [--steps N]}
shift
WHEELS=""
STEPS=40
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"

missing=$($PY - <<'PY'
import importlib.util
print(" ".join(m for m in ("deepspeed", "fairscale", "wandb", "einops", "tqdm", "yaml")
               if importlib.util.find_spec(m) is None))
PY
)
if [[ -n "$missing" ]]; then
  if [[ -z "$WHEELS" ]]; then
    echo "gpu_check.sh: missing Python packages ($missing); pass --wheels DIR with their wheels" >&2
    exit 2
  fi
  $PY -m pip install -q --no-index --no-deps --target /tmp/scale_ocr_site "$WHEELS"/*.whl || exit 2
  export PYTHONPATH=/tmp/scale_ocr_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export WANDB_MODE=${WANDB_MODE:-disabled}

$PY - <<'PY'
import torch
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} devices={torch.cuda.device_count()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY

status=0
for s in single dp ddp fsdp zero2 zero3; do
  echo "=== $s"
  start=$(date +%s)
  timeout 150 $PY scale_ocr/train.py --strategy "$s" --precision bf16 --max-steps "$STEPS" \
      --train-samples 8192 --val-samples 256 -b 64 -j 4 --resume none --output-dir "$OUT_DIR/$s" > "$OUT_DIR/$s.log" 2>&1
  rc=$?
  tail -n 1 "$OUT_DIR/$s.log"
  echo "rc=$rc seconds=$(( $(date +%s) - start ))"
  [[ $rc -eq 0 ]] || { status=1; tail -n 30 "$OUT_DIR/$s.log"; }
  [[ -f "$OUT_DIR/$s/metrics.json" ]] && cp "$OUT_DIR/$s/metrics.json" "$OUT_DIR/$s.metrics.json"
done

# The benchmark's GPU-only figures (CUDA allocated/reserved, MFU, NCCL comm share) and the memory model
# against CUDA tensors: a 21M-parameter ViT, one rank, bf16 (DeepSpeed holds bf16 weights).
echo "=== bench"
start=$(date +%s)
timeout 240 $PY -m benchmarks.scaling --models vitstr_small --strategies dp,ddp,fsdp,zero2,zero3 --world-sizes 1 \
    --batch-size 64 --steps 20 --warmup 5 --wandb-mode disabled --out "$OUT_DIR/bench" > "$OUT_DIR/bench.log" 2>&1
rc=$?
grep "^bench \[" "$OUT_DIR/bench.log"
echo "rc=$rc seconds=$(( $(date +%s) - start ))"
[[ $rc -eq 0 ]] || { status=1; tail -n 30 "$OUT_DIR/bench.log"; }

# The trainer against the textbook loop of each engine (benchmarks/hand_loop.py), one pair each: what the
# trainer's per-step work costs where host syncs matter most.
echo "=== overhead"
start=$(date +%s)
timeout 210 $PY -m benchmarks.overhead --strategies ddp,fsdp,zero2,zero3 --world-size 1 -b 64 --steps 30 --pairs 1 \
    --wandb-mode disabled --out "$OUT_DIR/overhead" > "$OUT_DIR/overhead.log" 2>&1
rc=$?
grep "^overhead \[" "$OUT_DIR/overhead.log"; grep "^| " "$OUT_DIR/overhead/report.md" 2>/dev/null | head -n 6
echo "rc=$rc seconds=$(( $(date +%s) - start ))"
[[ $rc -eq 0 ]] || { status=1; tail -n 30 "$OUT_DIR/overhead.log"; }

# Learning speed on the GPU: the default recipe against the bare textbook loop on 8192 synthetic words
# (benchmarks/convergence.py), two epochs each, exact match every 32 steps.
echo "=== convergence"
start=$(date +%s)
timeout 200 $PY -m benchmarks.convergence --sets synthetic --world-size 1 -b 64 -j 4 --synthetic-train 8192 \
    --synthetic-val 256 --synthetic-epochs 2 --eval-every 32 --wandb-mode disabled --timeout 90 \
    --out "$OUT_DIR/convergence" > "$OUT_DIR/convergence.log" 2>&1
rc=$?
grep "^convergence " "$OUT_DIR/convergence.log"; grep "^| " "$OUT_DIR/convergence/report.md" 2>/dev/null
echo "rc=$rc seconds=$(( $(date +%s) - start ))"
[[ $rc -eq 0 ]] || { status=1; tail -n 30 "$OUT_DIR/convergence.log"; }
exit $status
