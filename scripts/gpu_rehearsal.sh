#!/usr/bin/env bash
# Rehearse scripts/gpu_check.sh on CPU with the lent GPU machine's versions, before spending its rare minutes
# (docs/gpu-check.md, "Rehearsed on CPU with the device's versions"). Builds, if missing, a Python 3.12 venv with
# the machine's torch 2.11 (a CUDA build: it runs on CPU), transformers 5.17.0, lightning 2.6.6 and torchmetrics 1.9.0,
# installs the kit (.whl/, from scripts/gpu_kit.sh) as gpu_check.sh does (offline, --no-deps, into $SITE), records
# the versions, imports every module of the package and the benchmarks, and runs the CPU tests of the files the call
# runs (their CUDA tests skip) and the benchmarks' CPU smoke tests. Arguments go to pytest (-k, more test files).
#   VENV=/work/venv-device  PYTHON312=python3.12  SITE=/tmp/site-device
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VENV=${VENV:-/work/venv-device}
PYTHON312=${PYTHON312:-python3.12}
SITE=${SITE:-/tmp/site-device}

ls .whl/*.whl > /dev/null 2>&1 || { echo "gpu_rehearsal: no .whl/: run scripts/gpu_kit.sh first" >&2; exit 1; }
if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON312" -m venv "$VENV"
    # what the GPU machine has besides the kit (its deepspeed needs einops ... nvidia-ml-py), and pytest
    "$VENV/bin/python" -m pip install -q torch==2.11.0 transformers==5.17.0 lightning==2.6.6 torchmetrics==1.9.0 \
        accelerate einops msgpack ninja py-cpuinfo nvidia-ml-py pytest pytest-timeout
fi
rm -rf "$SITE"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD OMP_NUM_THREADS=1 DS_BUILD_OPS=0 TOKENIZERS_PARALLELISM=false

"$VENV/bin/python" -W ignore - <<'EOF'
import importlib, importlib.metadata as metadata, pkgutil, sys

import benchmarks, lightning_ulysses

print("python", sys.version.split()[0], *(f"| {n} {metadata.version(n)}" for n in (
    "torch", "transformers", "lightning", "torchmetrics", "accelerate", "deepspeed", "jsonargparse", "liger-kernel")))
for package in (lightning_ulysses, benchmarks):
    names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    names = [name for name in names if not name.endswith("__main__")]  # a __main__ runs the command line
    for name in names:
        importlib.import_module(name)
    print(f"imported the {len(names)} modules of {package.__name__}")
EOF
"$VENV/bin/python" -m pytest -q -rfs -p no:cacheprovider tests/test_ring.py tests/test_norms.py tests/test_offload.py \
    tests/test_liger.py tests/test_attention.py tests/test_kept_graph.py tests/test_head_chunks.py \
    tests/test_fused_loss.py tests/test_benchmarks.py tests/test_gpu_side_by_side.py "$@"
