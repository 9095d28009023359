#!/usr/bin/env bash
# Run HERE (the CPU machine), once per session that is lent a GPU (device tool): writes .whl/, the wheels
# that the GPU machine's Python (3.12, torch, lightning, transformers preinstalled) lacks: deepspeed (built
# pure Python, DS_BUILD_OPS=0) and its pydantic/hjson, jsonargparse for the CLI. Then run scripts/gpu_check.sh
# there with carry=[".whl"] (see that script).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .whl && mkdir -p .whl/src
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
python -m pip download -q --no-deps --no-binary=:all: -d .whl/src deepspeed==0.19.8
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/src/deepspeed-0.19.8.tar.gz
rm -rf .whl/src
ls -la .whl
