#!/usr/bin/env bash
# Download the wheels that `duetserve serve` needs on the lent GPU machine (Python 3.12, x86-64,
# no network, no FastAPI stack) into .whl/ (ignored by git), for a device call that names
# `.whl` in `carry` (scripts/device_serving.sh installs them into /tmp/site).
#
#   .whl/*.whl      missing on the GPU image (KINDS.md "Python packages already there"):
#                   always installed there.
#   .whl/opt/*.whl  on the image but at an unknown version: installed there only when the
#                   image's version does not satisfy the carried packages' requirements
#                   (scripts/device_serving.sh checks), so e.g. httpx keeps the image's h11.
#
# Versions are the ones of the development venv (tested together); one version each.
# Usage: bash scripts/fetch_device_wheels.sh   (needs pip and PyPI access here; about 3.5 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIRED=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  opentelemetry-api==1.45.2   # fastapi>=0.16x imports it (fastapi/telemetry)
  uvloop==0.23.0 httptools==0.9.0 orjson==3.13.0   # uvicorn's loop and parser; the SSE chunks
)
OPTIONAL=(
  anyio==4.16.0 typing-extensions==4.16.0 annotated-doc==0.0.7 click==8.5.1 h11==0.16.0
  prometheus-client==0.26.0 idna==3.20
)
PY=${PYTHON:-python3}
fetch() {  # dest, specs...
  local dest=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@"
}
rm -rf .whl && mkdir -p .whl/opt
fetch .whl "${REQUIRED[@]}"
fetch .whl/opt "${OPTIONAL[@]}"
grep -qxF '/.whl/' .gitignore || echo '/.whl/' >> .gitignore
ls .whl/*cp312*manylinux*x86_64*.whl > /dev/null  # pydantic-core must be the CPython 3.12 build
n=$(ls .whl/*.whl .whl/opt/*.whl | wc -l)
echo "fetched $n wheels into .whl/ ($(du -sh .whl | cut -f1)):"
ls -1 .whl/*.whl .whl/opt/*.whl
