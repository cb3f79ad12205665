#!/usr/bin/env bash
# Packs what kvflow's GPU checks need into one folder, for a GPU machine that reaches no registry:
# the release test and bench binaries (stripped), the NIXL runtime of the nixl-cu13 wheel (CUDA 13,
# as the GPU machine's driver) cut down to libnixl_capi.so, the UCX plugin and what they load, and
# run.sh, which runs the checks there (the tests with --include-ignored, the bench with KVFLOW_GPU=1).
#
#   crates/kv-demo/gpu/pack.sh [DEST]                # DEST defaults to .gpu at the workspace root
#   (on the GPU machine, from the folder holding DEST)  bash .gpu/run.sh
#
# Needs what `cargo xtask ci` needs (LIBCLANG_PATH for nixl-sys's build), python3 with pip, and
# readelf and strip (binutils). The wheel is cached under ~/.cache/kvflow, not in DEST, so that
# DEST stays small (about 18 MiB) for the trip.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
dest=${1:-$root/.gpu}
wheel=nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvflow
mkdir -p "$cache" "$dest/bin"

if [ ! -f "$cache/$wheel" ]; then
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --abi cp311 --platform manylinux_2_28_x86_64 --dest "$cache" nixl-cu13==1.5.1
fi
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
python3 -m zipfile -e "$cache/$wheel" "$unpacked/wheel"

# libnixl_capi.so, the UCX plugin and UCX's CUDA and CMA transports, with every library they
# need from the wheel (NEEDED entries resolved by file name, as their $ORIGIN rpaths do).
python3 - "$unpacked/wheel" > "$unpacked/files" <<'PY'
import os, re, subprocess, sys
root = sys.argv[1]
index = {}
for d, _, files in os.walk(root):
    for f in files:
        if ".so" in f:
            index.setdefault(f, os.path.join(d, f))
todo = [os.path.join(root, p) for p in (
    ".nixl_cu13.mesonpy.libs/libnixl_capi.so",
    ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
    "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0",
    "nixl_cu13.libs/ucx/libucm_cuda.so.0.0.0",
    "nixl_cu13.libs/ucx/libuct_cma.so.0.0.0",
)]
seen = set()
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.add(path)
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    todo += [index[n] for n in re.findall(r"NEEDED.*\[(.*)\]", dynamic) if n in index]
for path in sorted(seen):
    print(os.path.relpath(path, root))
PY
(cd "$unpacked/wheel" && tar -czf "$dest/nixl-cu13-1.5.1.tar.gz" -T "$unpacked/files")

# The release binaries: kv-cuda's unit and GPU tests, kv-demo's pool test and VRAM bench, and
# kv-transport-nixl's two-process tests (DRAM, with the cu13 runtime).
cd "$root"
declare -A names=([kv_cuda]=kv_cuda_unit [gpu]=gpu [pools]=pools [two_process]=two_process [vram]=vram)
{
  cargo test --release --locked --no-run -p kv-cuda -p kv-transport-nixl --message-format=json
  cargo test --release --locked --no-run -p kv-demo --features nixl --test pools --message-format=json
  cargo bench --locked --no-run -p kv-demo --features nixl --bench vram --message-format=json
} | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and (m["profile"]["test"] or "bench" in m["target"]["kind"]):
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  if [ -n "${names[$name]:-}" ]; then strip -o "$dest/bin/${names[$name]}" "$exe"; fi
done
cp "$root/crates/kv-demo/gpu/run.sh" "$dest/run.sh"
du -sh "$dest"
