#!/usr/bin/env bash
# The W4A16 wgmma kernel's PTX from several commits, each built into lmd._native and
# timed in turn in one device call (the host code stays the working tree's). Here,
# before the call:
#   rm -rf .ptx-versions && mkdir .ptx-versions &&
#   for r in REV...; do git show $r:native/kernels/w4a16_wgmma.ptx > .ptx-versions/$r.ptx; done
# (git-ignored: name .ptx-versions in the device tool's carry, with .whl). There:
#   scripts/gpu-ptx-versions.sh
# Each version, then the tree's own, replaces native/kernels/w4a16_wgmma.ptx for
# `w4a16_switches.py --rows 64 --rounds 2` (each run under a timeout, its JSON lines in
# $OUT/NAME.jsonl), and a line a version: the products' medians in us and their sum.
# The tree's PTX and build are what is left afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh >/dev/null
target=native/kernels/w4a16_wgmma.ptx
[[ -d .ptx-versions ]] || { echo "no .ptx-versions: see this script's header" >&2; exit 1; }
cp "$target" /tmp/tree.ptx
for ptx in .ptx-versions/*.ptx /tmp/tree.ptx; do
  name=$(basename "$ptx" .ptx)
  cp "$ptx" "$target"
  python3 setup.py -q build_ext --inplace >"$out/build-$name.log" 2>&1 || { echo "$name: build failed"; continue; }
  timeout 120 python3 scripts/w4a16_switches.py --rows 64 --rounds 2 --settings "native rows" \
    >"$out/$name.jsonl" 2>&1 || echo "$name: timed out or failed (rc $?)"
  python3 - "$name" "$out/$name.jsonl" <<'PY'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[2]) if '"native rows"' in line]
parts = " ".join("{}x{}:{}".format(r["n"], r["k"], r["median_us"]) for r in rows)
print(sys.argv[1], parts, "sum", round(sum(r["median_us"] for r in rows), 1))
PY
done
