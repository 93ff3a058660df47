#!/usr/bin/env bash
# Install everything (scripts/setup.sh --dev), then lint, type-check and run the tests.
# Extra arguments go to pytest (one process), e.g. scripts/test.sh -k lifecycle; without
# any, the suite runs on two processes (below).
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
echo "== systemd unit"
# systemd-analyze verify: CI machines have it (systemd); as root with apt, install it
# where it is missing. verify exits 0 on unknown keys and bad values (it only warns),
# so any line about our unit fails the step. It also checks that ExecStart's program
# exists: the unit runs lmd from /opt/lmd, so verify a copy pointing at this .venv.
if ! command -v systemd-analyze >/dev/null && [[ $EUID == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get -qq update && apt-get -qq install -y --no-install-recommends systemd >/dev/null; } ||
        echo "could not install systemd"
fi
if command -v systemd-analyze >/dev/null; then
    unit_dir=$(mktemp -d)
    sed "s|/opt/lmd/bin/|$PWD/.venv/bin/|g" systemd/lmdd.service >"$unit_dir/lmdd.service"
    verify_rc=0
    verify_out=$(systemd-analyze verify "$unit_dir/lmdd.service" 2>&1) || verify_rc=$?
    rm -rf "$unit_dir"
    if [[ $verify_rc != 0 ]] || grep -q "lmdd.service" <<<"$verify_out"; then
        echo "$verify_out"
        echo "systemd-analyze verify systemd/lmdd.service failed"
        exit 1
    fi
    echo "systemd/lmdd.service verified"
else
    echo "systemd-analyze not available: systemd/lmdd.service not verified"
fi
# tests/unit/test_membership.py runs a real etcd (it skips without one): as root with
# apt, install Debian's etcd-server where etcd is missing.
if ! command -v etcd >/dev/null && [[ $EUID == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get -qq update && apt-get -qq install -y --no-install-recommends etcd-server >/dev/null; } ||
        echo "could not install etcd-server"
fi
echo "== pytest"
# Two processes (pytest-xdist), a test file at a time on each (--dist loadfile: a module's
# daemon fixture serves its tests in one process); --durations: the slowest tests at the
# end, to see where the suite's time goes. Schemathesis runs apart, in one process: its
# tests are generated from the OpenAPI document at collection, and under xdist the
# workers' collections parted (1 of 7 operations was exercised).
# Extra arguments (a file, -k ...) run as given, in one process.
if (($#)); then
  exec $bin/python -m pytest -q -ra -m "not slow" --durations=30 "$@"
fi
SCHEMA=tests/integration/test_schemathesis.py
$bin/python -m pytest -q -ra -m "not slow" -n 2 --dist loadfile --durations=30 --ignore "$SCHEMA"
$bin/python -m pytest -q -ra -m "not slow" -p no:xdist "$SCHEMA"
