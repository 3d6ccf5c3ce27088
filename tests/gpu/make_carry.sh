#!/usr/bin/env bash
# Build the carry directory (default .gpuwheels/, git-ignored) for the H200 machines: Python 3.12, torch 2.11 CUDA and
# transformers are there; pydantic, ruamel.yaml and Ray are not, and a run may carry 64 MiB in all.
#   tests/gpu/make_carry.sh [DIR]      (on a machine with PyPI; then pass DIR as a carried path)
# Ray 2.60.0's wheel is 79 MB: the copy made here drops the Java jars, the dashboard's JS build and the libraries the
# runtime never imports (rllib, tune, serve, data, train, air, llm) and strips the binaries' symbols: ~23 MB as .tar.xz.
set -euo pipefail
dir=${1:-.gpuwheels}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dir" \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions ruamel.yaml \
  jsonschema attrs referencing rpds-py jsonschema-specifications
# The automodel backend: nemo-automodel and what its import needs beyond the image (which has transformers 5.17;
# nemo-automodel 0.7.0 pins 5.18.0 and fails on 5.17 for `resolve_revision`).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dir" \
  nemo-automodel==0.7.0 megatron-fsdp==0.5.0 torchao==0.18.0 torchdata==0.11.0 transformers==5.18.0
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d "$tmp" ray==2.60.0
(cd "$tmp" && unzip -q ray-*.whl && rm ray-*.whl \
  && rm -rf ray/jars ray/rllib ray/tune ray/serve ray/data ray/train ray/air ray/llm ray/dashboard/client/build \
  && find ray -name __pycache__ -prune -exec rm -rf {} + \
  && find ray -name '*.so' -exec strip --strip-unneeded {} + \
  && strip --strip-unneeded ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet \
  && rm -f ray-*.dist-info/RECORD && tar -cJf ray-trim.tar.xz ray ray-*.dist-info)
mv "$tmp/ray-trim.tar.xz" "$dir/"
cp ../shared/bench/plain_baseline.py "$dir/" 2>/dev/null || true
du -sh "$dir"
