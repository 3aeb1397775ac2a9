#!/usr/bin/env bash
# Every GPU check in one go, for a machine with CUDA, torch, cupy, nanobind and
# scikit-build-core (Ray is not needed): builds the native core into the tree, runs
# tests/gpu/, then the GPU benchmarks. Results go to $OUT (default results/gpu/).
#   bash tools/gpu_check.sh [quick]     (quick: the tests alone)
set -uo pipefail
out=${OUT:-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$py -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
began=$SECONDS
$py -m pip install -q --upgrade --no-build-isolation --no-deps --no-index --target /tmp/rx-build . \
  && cp /tmp/rx-build/raytrain_x/_native*.so raytrain_x/ || { echo "native build failed"; exit 1; }
echo "native core built in $((SECONDS - began)) s"
timeout 180 $py -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/tests.txt"
[ "${1:-}" = quick ] && exit 0
timeout 90 $py benchmarks/gpu_step.py --workers 2 --out "$out/gpu_step_2.json" 2>&1 | tail -8
timeout 45 $py benchmarks/gpu_step.py --workers 1 --out "$out/gpu_step_1.json" 2>&1 | tail -8
timeout 100 $py benchmarks/gpu_gloo_collectives.py --out "$out/gpu_gloo_collectives.json" 2>&1
timeout 150 $py benchmarks/zero_step.py --device cuda --layers 8 --width 1024 --batch 8 \
  --json "$out/zero_step_cuda.json" 2>&1
# each bucket's step and allgather as its reduction lands (rx1, rx2) against after them all
timeout 120 $py benchmarks/zero_step.py --device cuda --layers 8 --width 1024 --batch 8 \
  --ways rx1_sync rx1 rx2_sync rx2 2>&1 | tee "$out/zero_step_cuda_by_bucket.txt"
# an elastic commit's cost and device memory: host snapshots against deep copies on the GPU
timeout 240 $py benchmarks/elastic_commit.py --device cuda --layers 8 --width 1024 --batch 8 \
  --json "$out/elastic_commit_cuda.json" 2>&1
echo "all checks in $((SECONDS - began)) s"
