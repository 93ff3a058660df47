#!/usr/bin/env bash
# Install everything (scripts/setup.sh --dev), then lint, type-check and run the tests.
# Extra arguments go to pytest, e.g. scripts/test.sh -k lifecycle.
# GPU tests (tests/gpu) skip themselves without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
bin=.venv/bin
echo "== ruff"
$bin/ruff check .
$bin/ruff format --check .
echo "== mypy"
# The import packages live in folders named otherwise (daemon/ is lmd): give mypy a
# link tree with the real names.
mkdir -p build/typecheck
ln -sfn ../../daemon build/typecheck/lmd
ln -sfn ../../clients build/typecheck/lmd_client
$bin/mypy -p lmd -p lmd_client
$bin/mypy tests
echo "== pytest"
$bin/python -m pytest -q -ra -m "not slow" "$@"
