#!/usr/bin/env bash
# Run THERE (the lent GPU machine), after scripts/gpu_kit.sh here:
#   device run: command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560
# One H200: the CUDA tests (SDPA/flex kernels on packed documents, CUDA memory statistics, activation offload,
# a bf16 long-context probe with MFU), then the long-context benchmark of a 1B Llama, ZeRO-3 with and without
# the ALST memory options. Everything goes to $OUT/gpu_check.log and $OUT/gpu_long_context.md.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 OMP_NUM_THREADS=4
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, lightning, deepspeed, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'lightning', lightning.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
    timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_attention.py tests/test_callbacks.py \
        tests/test_memory.py tests/test_benchmarks.py -k "cuda or gpu or offload or flex"
    timeout 240 python3 -m benchmarks.gpu_long_context --model 1b --options zero3 zero3+alst \
        --start-seq-len 32768 --max-seq-len 1048576 --refine 0 --steps 3 --sp 1 --output "$OUT/gpu_long_context.md"
} 2>&1 | tee "$OUT/gpu_check.log"
