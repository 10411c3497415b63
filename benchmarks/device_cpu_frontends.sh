#!/usr/bin/env bash
# Frontend processes 1 -> N on the device machine's 16 CPU cores (its GPU unused): issue 54.
#
# The device image has torch, transformers, grpcio, protobuf and uvloop but no Ray and no
# default model. Prepare here (the CPU machine), from the repo root of this branch's tree:
#
#   python -m benchmarks.frontend --save-model .dev/fe54/bench-model   # the tiny model + tokenizer (~16 MB)
#   (the branch's files copied to /work/main/.dev/fe54, as /work/helpers/COMMON.md says)
#
# then on the device, three calls back to back (the wheels' parts, /work/shared/device/README.md):
#
#   run carry=[".devwheels/p1"] command="bash .devwheels/p1/install.sh"
#   run carry=[".devwheels/p2"] command="bash .devwheels/p2/install.sh"
#   run carry=[".devwheels/p3", ".dev/fe54"] command="bash .devwheels/p3/install.sh && bash .dev/fe54/benchmarks/device_cpu_frontends.sh"
#
# Prints the benchmark's table last (requests/s, tokens/s per frontend and the total against one
# frontend, measured in the same run); the whole log is kept in $OUT/frontends.log. Bounded to
# fit one 600 s call (FRONTENDS, NUM_DECODE, NUM_REQUESTS to change the sizes).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)  # the branch's tree (.dev/fe54)
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
ns=/tmp/ns-frontends-bench  # the tree imported as pdserve
mkdir -p $ns && ln -sfn "$here" $ns/pdserve && export PYTHONPATH=$ns:$PYTHONPATH
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0
out=${OUT:-/tmp}
model=$here/bench-model
[[ -f $model/config.json ]] || { echo "no tiny model in $model: run --save-model here first" >&2; exit 2; }
python3 -c "import ray, torch, transformers; print('ray', ray.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__)"
echo "cpus: $(nproc)  $(grep -m1 'model name' /proc/cpuinfo)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
cd "$here"
timeout 540 python3 -m benchmarks.frontend --model "$model" --frontends "${FRONTENDS:-1,2,4,8}" \
  --num-decode "${NUM_DECODE:-4}" --num-requests "${NUM_REQUESTS:-192}" --concurrency 32 --output-len 128 \
  2>&1 | tee "$out/frontends.log" | grep -E '^[0-9]+ frontend' || true
echo "--- table ---"
sed -n '/colocated worker/,$p' "$out/frontends.log"
