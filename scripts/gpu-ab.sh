#!/usr/bin/env bash
# The same command on the working tree's lmd and on an earlier commit's, in one device call
# (a before/after measurement on one machine). Here, before the call:
#   rm -rf .baseline && mkdir .baseline && git archive REV daemon | tar -x -C .baseline
# (git-ignored: name .baseline in the device tool's carry, with .whl). There:
#   scripts/gpu-ab.sh [ROUNDS] -- COMMAND...
# runs COMMAND ROUNDS times (default 1) on each side, new first, alternating; COMMAND's
# output goes to stdout with a "== new" / "== base" line before each run, and it sees
# $SIDE (new | base). lmd._native is built once and copied into the baseline, unless the
# baseline has its own native code (to A/B a kernel's change):
#   git archive REV daemon clients native setup.py pyproject.toml README.md | tar -x -C .baseline
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
rounds=1
[[ $1 != -- ]] && { rounds=$1; shift; }
shift
[[ -d .baseline/daemon ]] || { echo "no .baseline/daemon: see this script's header" >&2; exit 1; }
python3 setup.py -q build_ext --inplace 2>&1 | tail -3
if [[ -d .baseline/native ]]; then
  (cd .baseline && python3 setup.py -q build_ext --inplace 2>&1 | tail -3)
else
  cp daemon/_native*.so .baseline/daemon/
fi
mkdir -p /tmp/pkgs-base && ln -sfn "$PWD/.baseline/daemon" /tmp/pkgs-base/lmd &&
  ln -sfn "$PWD/clients" /tmp/pkgs-base/lmd_client
new_path=$PYTHONPATH
base_path=/tmp/pkgs-base:/tmp/site:$PWD
for ((r = 0; r < rounds; r++)); do
  for side in new base; do
    echo "== $side"
    path=$new_path
    [[ $side == base ]] && path=$base_path
    SIDE=$side PYTHONPATH=$path "$@"
  done
done
