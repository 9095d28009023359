#!/usr/bin/env bash
# Run HERE (a machine with network and the project's venv active), before scripts/gpu_check.sh runs on the lent
# GPU machine, which has no network: writes .whl/ (git-ignored; the device tool's `carry` ships it), the wheels that
# machine's Python lacks. It has torch, transformers, lightning, torchmetrics, accelerate, PyYAML, numpy, einops,
# msgpack, ninja, psutil, py-cpuinfo, tqdm and nvidia-ml-py; it lacks deepspeed (built here as a pure-Python
# py3-none-any wheel, DS_BUILD_OPS=0: no CUDA extension), its pydantic stack and hjson, and jsonargparse with the
# [signatures] extras, and liger-kernel (Triton kernels, pure Python; its needs, torch and triton, are there). The
# versions are those of the active environment, the ones the test suite ran with; liger-kernel, not in it, at
# LIGER_VERSION.
#   KIT_DIR=.whl (where)   KIT_PYTHON_VERSION=3.12 (the GPU machine's; pydantic-core is the one compiled wheel)
#   LIGER_VERSION=0.8.5
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
KIT_DIR=${KIT_DIR:-.whl}
KIT_PYTHON_VERSION=${KIT_PYTHON_VERSION:-3.12}
LIGER_VERSION=${LIGER_VERSION:-0.8.5}
LIMIT_MIB=60  # the device tool carries at most 64 MiB with the working tree

version() { python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pins() { for name in "$@"; do echo "$name==$(version "$name")"; done; }

rm -rf "$KIT_DIR" && mkdir -p "$KIT_DIR/src"
python -m pip download -q --no-deps --only-binary=:all: -d "$KIT_DIR" $(pins pydantic-core) \
    --python-version "$KIT_PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
python -m pip download -q --no-deps --only-binary=:all: -d "$KIT_DIR" \
    $(pins hjson pydantic annotated-types typing-inspection jsonargparse docstring-parser typeshed-client) \
    "liger-kernel==$LIGER_VERSION"
python -m pip download -q --no-deps --no-binary=:all: -d "$KIT_DIR/src" $(pins deepspeed)
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$KIT_DIR" "$KIT_DIR"/src/deepspeed-*.tar.gz
rm -rf "$KIT_DIR/src"

for wheel in "$KIT_DIR"/*.whl; do
    case "$wheel" in
        *pydantic_core-*) ;;
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *) echo "gpu_kit: $wheel is not a pure-Python wheel" >&2; exit 1 ;;
    esac
done
size_mib=$(du -sm "$KIT_DIR" | cut -f1)
if (( size_mib > LIMIT_MIB )); then
    echo "gpu_kit: $KIT_DIR is $size_mib MiB, over the $LIMIT_MIB MiB that leave room for the working tree" >&2
    exit 1
fi
ls -1 "$KIT_DIR"
echo "gpu_kit: $(ls "$KIT_DIR" | wc -l) wheels, $size_mib MiB in $KIT_DIR (for Python $KIT_PYTHON_VERSION)"
