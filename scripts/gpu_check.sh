#!/usr/bin/env bash
# The GPU check, for the lent machine: one H200, no network, Python 3.12 with torch, transformers, lightning,
# torchmetrics and accelerate preinstalled; no deepspeed, jsonargparse or flash-attn. First, HERE:
#   bash scripts/gpu_kit.sh                       # writes .whl/ (about 6 MiB of wheels; git-ignored)
# then through the device tool, from the repository root:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
# Steps, each stopped at its own time limit and all within BUDGET_S (540 s): install the wheels offline into
# /tmp/site; record the GPU and versions; the ring's CUDA block kernels first (bf16 exact since
# the layout fix, 2026-12-04's second run), then every CUDA-only test (marked cuda in tests/); one
# long-context probe per attention kernel: Llama 1B, bf16, ZeRO-3 with tiled MLP, tiled loss, checkpointing and
# offload, one process, PROBE_SEQ_LEN tokens, with torch's SDPA restricted to its flash kernel, then compiled flex.
# Each result is written to $OUT as soon as it exists (8 files; the device tool returns at most 8):
#   status.txt     one line per step as it ends: exit code, seconds, "stopped at its time limit"
#   env.txt        nvidia-smi, versions, the offline install's output
#   ring_tests.log, cuda_tests.log  pytest -v -rfs output (a line per test as it ends; failures and skip reasons at
#                  the end)
#   probe_sdpa.log, probe_sdpa.md, probe_flex.log, probe_flex.md   benchmarks.gpu_long_context's log and table
# Exit code: 0 when every step passed, 1 when a step failed, 2 when torch sees no CUDA device (nothing measured).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
PYTHON=${PYTHON:-python3}
KIT_DIR=${KIT_DIR:-.whl}
SITE=${SITE:-/tmp/site}
BUDGET_S=${BUDGET_S:-540}
PROBE_SEQ_LEN=${PROBE_SEQ_LEN:-131072}
mkdir -p "$OUT"
STATUS=$OUT/status.txt
: > "$STATUS"
failed=0

note() { echo "gpu_check: $*" | tee -a "$STATUS" >&2; }

# step NAME SECONDS LOG COMMAND...: run COMMAND with its output in LOG, stopped after SECONDS or at the budget's end
step() {
    local name=$1 cap=$2 log=$3 left=$((BUDGET_S - SECONDS)) start=$SECONDS rc
    shift 3
    (( cap > left )) && cap=$left
    if (( cap < 20 )); then note "$name: skipped, the ${BUDGET_S} s budget is spent"; failed=1; return; fi
    timeout -k 10 "$cap" "$@" >> "$log" 2>&1
    rc=$?
    local why=""
    (( rc == 124 || rc == 137 )) && why=" (stopped at its time limit, ${cap} s)"
    (( rc != 0 )) && failed=1
    note "$name: exit $rc after $((SECONDS - start)) s$why"
}

ls "$KIT_DIR"/*.whl > /dev/null 2>&1 || {
    note "no wheels in $KIT_DIR/: run scripts/gpu_kit.sh on the machine with network first, and carry $KIT_DIR"
    exit 1
}
step install 60 "$OUT/env.txt" "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$KIT_DIR"/*.whl
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
    "$PYTHON" - <<'EOF'
import sys

import deepspeed, jsonargparse, lightning, torch, torchmetrics, transformers

print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| lightning", lightning.__version__, "| torchmetrics",
      torchmetrics.__version__, "| deepspeed", deepspeed.__version__, "from", deepspeed.__path__[0],
      "| jsonargparse", jsonargparse.__version__)
print("devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
} >> "$OUT/env.txt" 2>&1 || { note "the environment check failed: see env.txt"; exit 1; }
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    note "torch sees no CUDA device: the CUDA tests and the probes need the lent GPU machine; nothing was measured"
    exit 2
fi

step ring_tests 60 "$OUT/ring_tests.log" "$PYTHON" -m pytest -v -rfs --tb=short -p no:cacheprovider tests/test_ring.py \
    -m cuda
step cuda_tests 200 "$OUT/cuda_tests.log" "$PYTHON" -m pytest -v -rfs --tb=short -p no:cacheprovider tests -m cuda \
    --deselect tests/test_ring.py
probe=(-m benchmarks.gpu_long_context --model 1b --options zero3+alst --sp 1 --steps 3 --refine 0
       --start-seq-len "$PROBE_SEQ_LEN" --max-seq-len "$PROBE_SEQ_LEN")
step probe_sdpa 150 "$OUT/probe_sdpa.log" "$PYTHON" "${probe[@]}" --attn-implementation sdpa --sdpa-backend flash \
    --probe-timeout 140 --output "$OUT/probe_sdpa.md"
step probe_flex 180 "$OUT/probe_flex.log" "$PYTHON" "${probe[@]}" --attn-implementation flex_attention \
    --probe-timeout 170 --output "$OUT/probe_flex.md"
note "done in $SECONDS s"
exit $failed
