#!/usr/bin/env bash
# The benchmark runs behind docs/benchmarks.md and docs/experiments.md, in order.
set -x
cd "$(dirname "$0")/.."
mkdir -p bench-out
py=.venv/bin/python
$py -m gradwire bench codecs --json bench-out/codecs.json > bench-out/codecs.txt 2>&1
$py -m gradwire bench sparsify --json bench-out/sparsify.json > bench-out/sparsify.txt 2>&1
$py -m gradwire bench sparsify --threads 1 --json bench-out/sparsify-1t.json > bench-out/sparsify-1t.txt 2>&1
$py -m gradwire bench lowrank --json bench-out/lowrank.json > bench-out/lowrank.txt 2>&1
$py -m gradwire bench hostile --costs --json bench-out/hostile.json > bench-out/hostile.txt 2>&1
$py -m gradwire bench e2e --workers 4 --bandwidths 100mbit,1gbit,10gbit --rounds 2 --accuracy \
  --accuracy-methods "allreduce;topk:density=0.01,values=fp16,indices=rice;topk:density=0.01,values=fp32,indices=rice;pufferfish:rank_ratio=0.25,warmup_epochs=1" \
  --out bench-out/e2e > bench-out/e2e.txt 2>&1
echo done > bench-out/ALL_DONE
