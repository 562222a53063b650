#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("GPU"), in priority order, on a CUDA machine where specserve is installed:
# the CUDA suite, then the shipped EAGLE-3 pair at batch 1 on MT-bench (fp32, then bf16), then the guarded straggler
# sweep at batch 1-32. Each stage writes under OUT_DIR as it ends, so a run cut short keeps what it finished.
#
#   cluster/gpu_checks.sh [OUT_DIR]        # default bench_out/gpu
#
# Environment: PYTHON (default: .venv/bin/python of this repo, else python3; on a `ray up` node or in the image,
# PYTHON=~/venv/bin/python), STAGES (default "suite spec bf16 straggler"; any subset, in that order). The suite stage
# needs pytest (the `dev` extra: `make install` has it; the cluster's and the image's `.[gpu]` install has not).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(realpath -m "${1:-$REPO/bench_out/gpu}")" # absolute: the stages run from the repository
if [ -n "${PYTHON:-}" ]; then # a path, or a bare name (PYTHON=python3.12) from the PATH; none other in its place
  PY="$(command -v "$PYTHON")" || { echo "PYTHON=$PYTHON: no such interpreter" >&2; exit 2; }
else
  PY="$REPO/.venv/bin/python"
  [ -x "$PY" ] || PY="$(command -v python3)"
fi
STAGES="${STAGES:-suite spec bf16 straggler}"
for stage in $STAGES; do # a misspelt stage is named before any stage runs (not a failure among the stages')
  case "$stage" in
    suite | spec | bf16 | straggler) ;;
    *) echo "unknown stage $stage (suite, spec, bf16, straggler)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
cd "$REPO" || exit 1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
specserve() { "$PY" -c 'import sys; from specserve.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
status=0
for stage in $STAGES; do
  case "$stage" in
    suite)
      "$PY" -c "import pytest" 2>/dev/null || { echo "suite: no pytest for $PY (pip install -e '.[dev]')" >&2; status=1; continue; }
      "$PY" -m pytest -q -rs tests/test_cuda.py tests/test_model.py::test_flash_attn_varlen_matches_sdpa_on_cuda \
        2>&1 | tee "$OUT_DIR/suite.log" || status=1 ;;
    spec)
      specserve bench spec --device cuda --pairs smollm2-eagle --methods chain eagle2 ddd --chain-sl 1 4 \
        --budget 6 16 32 --ddd-checks 1,2,3 2,3,4 --ddd-x -0.03 -0.3 --guarded-default --per-category 1 \
        --max-tokens 64 --repeats 2 --out "$OUT_DIR/spec_fp32" || status=1 ;;
    bf16)
      specserve bench spec --device cuda --dtype bfloat16 --pairs smollm2-eagle --methods ddd --budget 6 16 32 \
        --ddd-checks 1,2,3 --ddd-x -0.03 --guarded-default --per-category 1 --max-tokens 64 --repeats 2 \
        --out "$OUT_DIR/spec_bf16" || status=1 ;;
    straggler)
      "$PY" -m load.straggler --pair smollm2-eagle --device cuda --requests-per-slot 2 --repeats 3 \
        --categories coding writing --min-tokens 48 --max-tokens 64 --workloads real --batch-sizes 1 4 16 32 \
        --policies plain ddd --budget 32 --beam-width 10 --ddd-checks 2,3,4 --ddd-x -0.03 --guard --warm-guard \
        --max-step-tokens 64 --out "$OUT_DIR/straggler_guarded" || status=1 ;;
  esac
done
exit $status
