#!/usr/bin/env bash
# The benchmark runs behind docs/benchmarks.md and docs/experiments.md, in order.
set -x
cd "$(dirname "$0")/.."
mkdir -p bench-out
py=.venv/bin/python
$py -m gradwire bench codecs --json bench-out/codecs.json > bench-out/codecs.txt 2>&1
$py -m gradwire bench sparsify --json bench-out/sparsify.json > bench-out/sparsify.txt 2>&1
$py -m gradwire bench sparsify --threads 1 --json bench-out/sparsify-1thread.json > bench-out/sparsify-1thread.txt 2>&1
$py -m gradwire bench lowrank --json bench-out/lowrank.json > bench-out/lowrank.txt 2>&1
$py -m gradwire bench e2e --workers 4 --bandwidths 100mbit,1gbit,10gbit --accuracy --out bench-out/e2e > bench-out/e2e.txt 2>&1
echo done > bench-out/ALL_DONE
