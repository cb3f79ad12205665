#!/usr/bin/env bash
# kvflow's GPU checks: kv-cuda's GPU tests, the two-process VRAM test, the VRAM bench.
# Runs on the GPU machine from the folder that pack.sh filled (binaries, nixl-cu13 runtime, this file);
# logs go to $OUT (the device tool), else /tmp/out. The GPU tests are #[ignore = "needs a CUDA device"],
# so the test binaries run with --include-ignored; KVFLOW_GPU=1 asks the VRAM bench to run.
# Exits non-zero if anything failed, skipped or was left ignored.
set -u
G=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/nixl13 && tar -xzf "$G/nixl-cu13-1.5.1.tar.gz" -C /tmp/nixl13
export KVFLOW_NIXL_DIR=/tmp/nixl13/.nixl_cu13.mesonpy.libs KVFLOW_GPU=1 CI=true
# UCX's CUDA memory hooks (libucm_cuda) want libcudart.so.13; UCX works without them, but look.
rt=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt -name 'libcudart.so.13*' 2>/dev/null | head -1)
[ -n "$rt" ] && export LD_LIBRARY_PATH=$(dirname "$rt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "libcudart: ${rt:-none}"
{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; } > "$OUT/nvidia-smi.txt" 2>&1
head -n 12 "$OUT/nvidia-smi.txt"; tail -n 2 "$OUT/nvidia-smi.txt"
status=0
run() {
  name=$1; shift; echo "=== $name: $*"
  ( "$@" ) > "$OUT/$name.log" 2>&1; rc=$?
  grep -E "^test |^test result|skipped|GB/s|panicked|^vram|^way|^cuMemcpy|^NIXL|^UCX_|^\{" "$OUT/$name.log" | grep -v "^\[" | tail -n 30
  echo "=== $name rc=$rc"
  [ $rc -eq 0 ] || status=1
  if grep -q "skipped" "$OUT/$name.log"; then echo "!!! $name skipped something"; status=1; fi
  if grep -qE "^test result:.* [1-9][0-9]* ignored" "$OUT/$name.log"; then echo "!!! $name left tests ignored"; status=1; fi
}
cd /tmp
run kv_cuda_unit "$G/bin/kv_cuda_unit" --include-ignored --test-threads=1
run gpu "$G/bin/gpu" --include-ignored --test-threads=1
UCX_PROTO_INFO=y run pools "$G/bin/pools" --include-ignored --test-threads=1 --nocapture
run two_process "$G/bin/two_process" --include-ignored --test-threads=1
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto run vram_ucx_auto "$G/bin/vram" --iters 20 --json
run vram "$G/bin/vram" --iters 20 --json
echo "=== UCX protocols seen with device memory (pools, UCX_PROTO_INFO=y):"
sed 's/^\[[^]]*\] \[[^]]*\] *//' "$OUT/pools.log" | grep -A7 -E "remote memory (read|write).*(cuda|GPU)" \
  | grep -E "remote memory|^\| +[0-9]" | awk '!seen[$0]++' | head -n 40
echo "=== overall status $status"
exit $status
