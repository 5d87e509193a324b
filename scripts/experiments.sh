#!/usr/bin/env bash
# Paper-style experiments behind docs/experiments.md: ResNet-18 (CIFAR-shaped synthetic input,
# batch 32 per worker, 1 thread each), 4 workers in network namespaces behind 1 Gbit/s links
# (root), 2 warm-up steps then 5 measured steps per method. Results land in bench-out/exp-*.json.
set -x
cd "$(dirname "$0")/.."
mkdir -p bench-out
train() { .venv/bin/python -m gradwire train --model resnet18 --workers 4 --epochs 1 --steps 7 --warmup-steps 2 --no-eval \
            --cluster --bandwidth "$BW" "$@"; }
BW=1gbit
# 1. time breakdown (random-block paper): allreduce vs topk / randomk / randomblock at 1%
train --json bench-out/exp-breakdown.json --method allreduce --method topk:density=0.01 \
      --method randomk:density=0.01 --method randomblock:density=0.01 > bench-out/exp-breakdown.txt 2>&1
# 2. layer-wise vs global scope (topk 1%), and AllReduce vs AllGather for a shared support (randomk 1%)
train --json bench-out/exp-scope-collective.json --method allreduce --method topk:density=0.01,scope=layer \
      --method topk:density=0.01,scope=global --method randomk:density=0.01,collective=allreduce \
      --method randomk:density=0.01,collective=allgather > bench-out/exp-scope-collective.txt 2>&1
# 3. DeepReduce codecs on top of sampled top-k 1% (COO baseline = raw indices + fp32 values)
train --json bench-out/exp-codecs.json --method allreduce \
      --method sampled-topk:density=0.01,indices=raw,values=fp32 \
      --method sampled-topk:density=0.01,indices=rice,values=fp32 \
      --method sampled-topk:density=0.01,indices=rice,values=fp16 \
      --method sampled-topk:density=0.01,indices=bloom,values=qsgd,bits=8,fpr=0.001 > bench-out/exp-codecs.txt 2>&1
# 4. the same at 100 Mbit/s, where the link dominates
BW=100mbit
train --json bench-out/exp-codecs-100mbit.json --method allreduce \
      --method sampled-topk:density=0.01,indices=raw,values=fp32 \
      --method sampled-topk:density=0.01,indices=rice,values=fp16 > bench-out/exp-codecs-100mbit.txt 2>&1
echo done > bench-out/EXP_DONE
