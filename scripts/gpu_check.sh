#!/usr/bin/env bash
# The prepared call for a lent GPU machine (one H100 or H200, no network, Python 3.12 with torch, transformers,
# lightning, torchmetrics and accelerate; no deepspeed, jsonargparse, flash-attn or liger-kernel). First, HERE:
#   bash scripts/gpu_kit.sh                       # writes .whl/ (git-ignored; under 60 MiB)
# then through the device tool, from the repository root:
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
# Steps, each stopped at its own time limit (the second field of each `step` line) and all within BUDGET_S:
#   install     the wheels, offline, into $SITE
#   (env)       nvidia-smi, versions (not timed: seconds)
#   cuda_tests  a short CUDA test selection: the ring's block kernels, the fused norms, offload on a side stream,
#               Liger's kernels, SDPA's cuDNN backend against float64, kept kernel graphs (head chunks)
#   sbs_1b      benchmarks.gpu_side_by_side: Llama-3.2-1B whole, ALST / ours / ours+all at SBS_1B_SEQ_LEN tokens
#   sbs_8b      the same on Llama-3.1-8B's widths with SBS_8B_LAYERS layers, sides in reverse order, then the longest
#               sequence probed for alst and ours+all with what is left of the step's time
#   kernels     python -m benchmarks.kernels: attention kernels (SDPA flash, cuDNN, flex), Liger, compiled layers
# STEPS (a space-separated subset, in this order) runs fewer. Each result is written to $OUT as soon as it exists;
# the device tool returns at most 8 files, these:
#   status.txt          one line per step as it ends: exit code, seconds, "stopped at its time limit"
#   env.txt             nvidia-smi, versions, the install's output
#   cuda_tests.log      pytest -v -rfs output
#   side_by_side.md     the side-by-side report of both models (rewritten after every side and probe)
#   side_by_side.jsonl  every measurement, one JSON line each, as it is made
#   side_by_side.log    both side-by-side runs' output
#   kernels.md, kernels.log   benchmarks.kernels' report and output
# Exit code: 0 when every step passed, 1 when a step failed (or no wheels were carried), 2 when torch sees no CUDA
# device (nothing measured).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
PYTHON=${PYTHON:-python3}
KIT_DIR=${KIT_DIR:-.whl}
SITE=${SITE:-/tmp/site}
BUDGET_S=${BUDGET_S:-510}
STEPS=${STEPS:-install cuda_tests sbs_1b sbs_8b kernels}
SBS_1B_SEQ_LEN=${SBS_1B_SEQ_LEN:-32768}
SBS_8B_SEQ_LEN=${SBS_8B_SEQ_LEN:-65536}
SBS_8B_LAYERS=${SBS_8B_LAYERS:-2}
SBS_8B_CAP=${SBS_8B_CAP:-210}
mkdir -p "$OUT"
STATUS=$OUT/status.txt
: > "$STATUS"
failed=0

note() { echo "gpu_check: $*" | tee -a "$STATUS" >&2; }

# step NAME SECONDS LOG COMMAND...: run COMMAND with its output in LOG, stopped after SECONDS or at the budget's end
step() {
    local name=$1 cap=$2 log=$3 left=$((BUDGET_S - SECONDS)) start=$SECONDS rc
    shift 3
    [[ " $STEPS " == *" $name "* ]] || return 0
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
step install 30 "$OUT/env.txt" "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$KIT_DIR"/*.whl
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
    "$PYTHON" - <<'EOF'
import importlib.metadata as metadata
import sys

import deepspeed, jsonargparse, lightning, torch, torchmetrics, transformers

print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| lightning", lightning.__version__, "| torchmetrics",
      torchmetrics.__version__, "| deepspeed", deepspeed.__version__, "from", deepspeed.__path__[0],
      "| jsonargparse", jsonargparse.__version__)
for name in ("liger-kernel", "triton", "flash-attn"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
print("devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
} >> "$OUT/env.txt" 2>&1 || { note "the environment check failed: see env.txt"; exit 1; }
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    note "torch sees no CUDA device: the CUDA tests and the benchmarks need the lent GPU machine; nothing was measured"
    exit 2
fi

step cuda_tests 60 "$OUT/cuda_tests.log" "$PYTHON" -m pytest -v -rfs --tb=short -p no:cacheprovider -m cuda \
    tests/test_ring.py tests/test_norms.py tests/test_offload.py tests/test_liger.py tests/test_attention.py \
    tests/test_kept_graph.py -k "not test_attention.py or cudnn"
sbs=(-m benchmarks.gpu_side_by_side --out-dir "$OUT" --timed-steps 3)
step sbs_1b 120 "$OUT/side_by_side.log" "$PYTHON" "${sbs[@]}" --model 1b --seq-len "$SBS_1B_SEQ_LEN" \
    --sides alst ours ours+all --probe-sides --budget-s 110
left=$((BUDGET_S - SECONDS))
sbs_8b_budget=$(( (SBS_8B_CAP < left ? SBS_8B_CAP : left) - 20 ))  # imports, and the report after the last probe
step sbs_8b "$SBS_8B_CAP" "$OUT/side_by_side.log" "$PYTHON" "${sbs[@]}" --model 8b --layers "$SBS_8B_LAYERS" \
    --seq-len "$SBS_8B_SEQ_LEN" --sides ours+all ours alst --probe-sides ours+all alst --budget-s "$sbs_8b_budget"
step kernels 70 "$OUT/kernels.log" "$PYTHON" -m benchmarks.kernels --output "$OUT/kernels.md"
note "done in $SECONDS s"
exit $failed
