#!/usr/bin/env bash
# `make gpu-check` runs the check (launch/gpu_check.py) with the Python that holds CUDA torch: the
# project's .venv when it has one, else the machine's python3 (a bare GPU machine), with the pinned
# packages it lacks installed from the wheels in .whl/ into a scratch directory (nothing is fetched).
# `make gpu-check-wheels` fills .whl/ here, where pip can reach the registry (GPU_PYTHON=3.12 is the
# GPU machine's Python version).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# What a bare GPU machine with CUDA, PyTorch, Triton and transformers lacks of our pins for a training run.
NEEDED="megatron-core hydra-core omegaconf antlr4-python3-runtime pydantic pydantic_core annotated-types
typing-inspection hjson tabulate zstandard deepspeed"

pin() { grep -i "^$1==" constraints.txt || { echo "constraints.txt has no pin for $1" >&2; exit 2; }; }

if [ "${1:-check}" = wheels ]; then
  PY=${PY:-.venv/bin/python}
  mkdir -p "$WHEELS"
  for name in $NEEDED; do
    case $name in
      antlr4-python3-runtime) "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$(pin "$name")" ;;   # sdist only
      deepspeed) DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$(pin "$name")" ;;
      *) "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
           --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
           --platform manylinux2014_x86_64 -d "$WHEELS" "$(pin "$name")" ;;
    esac
  done
  ls "$WHEELS"; du -sh "$WHEELS"
  exit 0
fi

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ "${DRY_RUN:-}" ] && [ "$DRY_RUN" != 0 ]; then
  exec "$PY" -m launch.gpu_check
fi
if ! "$PY" -c "import megatron.core, hydra, deepspeed" 2>/dev/null; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "$PY lacks megatron-core/hydra/deepspeed and $WHEELS/ holds no wheels: run make gpu-check-wheels where pip works, and carry $WHEELS" >&2; exit 2; }
  SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
  echo ">> installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m launch.gpu_check
