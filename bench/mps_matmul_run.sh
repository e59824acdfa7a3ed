#!/usr/bin/env bash
# The MPS matmul fault on the GPU machine, in one call (bench/results/matmul-mps-h200/README.md):
#   OUT=/some/dir bash bench/mps_matmul_run.sh
# Starts an MPS control daemon, then under several CUDA_MPS_ACTIVE_THREAD_PERCENTAGE values checks PyTorch's
# bf16 products against float32 (bench/gemm_finite_check.py), reproduces the engine's non-finite logits at
# 75 % with the start-up check off (bench/nonfinite_hunt.py, variants that bisect it), and shows the check
# refusing to start at 75 % and passing at 50 %. Writes $OUT/matmul-mps-h200.tgz.
set -u
R=$OUT/matmul-mps-h200
mkdir -p "$R"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$R/env.txt" 2>&1
for pct in 25 50 60 70 75 80 90 100; do
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 120 python3 bench/gemm_finite_check.py --kernels \
    --out "$R/gemm-mps$pct.json" > "$R/gemm-mps$pct.log" 2>&1
  echo "gemm $pct rc $?" >> "$R/log.txt"
done
HUNT="--config config/serve-h200.yaml --preset full --random-weights --device cuda --arrivals 32 --interval-ms 130"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 timeout 240 python3 bench/nonfinite_hunt.py $HUNT --no-check-matmuls \
  --variants base,nocache,sync,solo,torchops --out "$R/hunt-mps75-nocheck.json" > "$R/hunt-mps75-nocheck.log" 2>&1
echo "hunt 75 nocheck rc $?" >> "$R/log.txt"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 timeout 120 python3 bench/nonfinite_hunt.py $HUNT --variants base \
  --out "$R/hunt-mps75-check.json" > "$R/hunt-mps75-check.log" 2>&1
echo "hunt 75 check rc $?" >> "$R/log.txt"
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout 120 python3 bench/nonfinite_hunt.py $HUNT --variants base \
  --out "$R/hunt-mps50-check.json" > "$R/hunt-mps50-check.log" 2>&1
echo "hunt 50 check rc $?" >> "$R/log.txt"
echo quit | nvidia-cuda-mps-control
tar czf "$OUT/matmul-mps-h200.tgz" -C "$OUT" matmul-mps-h200 && rm -rf "$R"
