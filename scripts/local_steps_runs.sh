#!/usr/bin/env bash
# The runs behind docs/local-steps.md; then `python scripts/local_steps_report.py` prints its tables.
#
#   scripts/local_steps_runs.sh sim NAME SEED METHOD   one simulated run -> docs/lm/local-steps/NAME-sSEED.json
#   scripts/local_steps_runs.sh sims                   every simulated run of the doc (2-4 at a time is what
#                                                      a 2-core machine holds; each is ~15 min alone)
#   scripts/local_steps_runs.sh timing RATE OUT        the emulated cluster at RATE (root), e.g. 100mbit
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src" OMP_NUM_THREADS=1

# the calibration's setting: 4 workers x 1500 AdamW steps (lr 2e-3), 16 x 128 bytes each
sim() {
    nice -n 10 python -m gradwire simulate --workers 4 --steps 1500 --batch-size 16 --optimizer adamw --lr 2e-3 \
        --eval-every 100 --seed "$2" --method "$3" --json "docs/lm/local-steps/$1-s$2.json"
}

W=warmup_steps=300
TOPK="values=qsgd-ans,indices=rice,collective=allgather"
TOPK16="values=fp16,indices=rice,collective=allgather"
SIMS=(
    "ddp|allreduce"
    "dense-h16|diloco:sync_every=16,$W"
    "int8-h16|diloco:sync_every=16,$W+quantize:bits=8"
    "int4-h16|diloco:sync_every=16,$W+quantize:bits=4"
    "int4-h16-warm8|diloco:sync_every=16,$W,warmup_quantize=int8+quantize:bits=4"
    "dense-h32|diloco:sync_every=32,$W"
    "int4-h32|diloco:sync_every=32,$W+quantize:bits=4,block=512"
    "int4-h32-b1024|diloco:sync_every=32,$W+quantize:bits=4,block=1024"
    "int4-h16-warm8e100|diloco:sync_every=16,$W,warmup_quantize=int8,warmup_exact=100+quantize:bits=4"
    "int4-h16-warm8e25|diloco:sync_every=16,$W,warmup_quantize=int8,warmup_exact=25+quantize:bits=4"
    "int4-h16-warm8-overlap1|diloco:sync_every=16,$W,warmup_quantize=int8,overlap=1+quantize:bits=4"
    "streaming-f4|diloco:sync_every=16,$W,fragments=4,overlap=1"
    "streaming-f4-carry|diloco:sync_every=16,$W,fragments=4,overlap=1,merge=carry"
    "streaming-f4-carry-warm8e100|diloco:sync_every=16,$W,warmup_quantize=int8,warmup_exact=100,fragments=4,overlap=1,merge=carry"
    "streaming-f4-tau4-carry|diloco:sync_every=16,$W,fragments=4,overlap=4,merge=carry"
    "streaming-f4-noov|diloco:sync_every=16,$W,fragments=4"
    "topk10-chunk64-fp16|diloco:sync_every=16,$W,unsent=residual+chunktopk:density=0.1,chunk=64,values=fp16,indices=rice,collective=allgather"
    "topk10-reset|diloco:sync_every=16,$W,unsent=residual+topk:density=0.1,$TOPK"
    "sparseloco3|diloco:sync_every=16,$W,outer_lr=1,outer_momentum=0,decay=0.9,unsent=residual+topk:density=0.03,$TOPK"
    "topk10-model|diloco:sync_every=16,$W,unsent=model+topk:density=0.1,$TOPK"
    "topk3-model|diloco:sync_every=16,$W,unsent=model+topk:density=0.03,$TOPK"
    "topk1-model|diloco:sync_every=16,$W,unsent=model+topk:density=0.01,$TOPK"
    "topk10-model-fp16|diloco:sync_every=16,$W,unsent=model+topk:density=0.1,$TOPK16"
    "topk3-model-fp16|diloco:sync_every=16,$W,unsent=model+topk:density=0.03,$TOPK16"
    "topk1-model-fp16-h32|diloco:sync_every=32,$W,unsent=model+topk:density=0.01,$TOPK16"
    "topk2-model-q3-h32|diloco:sync_every=32,$W,unsent=model+topk:density=0.02,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "dense-h64|diloco:sync_every=64,$W"
    "topk4-model-q3-h64|diloco:sync_every=64,$W,unsent=model+topk:density=0.04,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "topk10-model-q3|diloco:sync_every=16,$W,unsent=model+topk:density=0.1,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "topk4-model-q7-h64|diloco:sync_every=64,$W,unsent=model+topk:density=0.04,values=qsgd-ans,levels=7,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "dense-h128|diloco:sync_every=128,$W"
    "topk10-model-q3-h128|diloco:sync_every=128,$W,unsent=model+topk:density=0.1,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "streaming-f4-carry-h128|diloco:sync_every=128,$W,fragments=4,overlap=1,merge=carry"
    "topk10-model-q3-h128-global|diloco:sync_every=128,$W,unsent=model+topk:density=0.1,scope=global,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "topk10-model-q3-h128-f4-carry|diloco:sync_every=128,$W,fragments=4,overlap=1,merge=carry,unsent=model+topk:density=0.1,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "dense-h240|diloco:sync_every=240,$W"
    "topk10-model-q3-h240|diloco:sync_every=240,$W,unsent=model+topk:density=0.1,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "topk20-model-q3-h240|diloco:sync_every=240,$W,unsent=model+topk:density=0.2,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=allgather"
    "blocktopk10-c32-model-q3-h64|diloco:sync_every=64,$W,unsent=model+blocktopk:density=0.1,chunk=32,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rle,collective=allgather"
    "blocktopk10-c16-model-q3-h64|diloco:sync_every=64,$W,unsent=model+blocktopk:density=0.1,chunk=16,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rle,collective=allgather"
    "topk10-model-q3-h64-sar|diloco:sync_every=64,$W,unsent=model+topk:density=0.1,values=qsgd-ans,levels=3,norm=range,rounding=nearest,bucket_size=128,indices=rice,collective=sparse-allreduce"
    "randomk3-model-fp16-h32|diloco:sync_every=32,$W,unsent=model+randomk:density=0.03,values=fp16,collective=allreduce"
    "randomblock3-model-fp16-h32|diloco:sync_every=32,$W,unsent=model+randomblock:density=0.03,values=fp16,collective=allreduce"
    "topk10-decay09-fp16|diloco:sync_every=16,$W,decay=0.9,unsent=residual+topk:density=0.1,$TOPK16"
    "topk10-mc09-fp16|diloco:sync_every=16,$W,outer_momentum=0,unsent=residual+topk:density=0.1,$TOPK16,momentum_correction=0.9"
    "topk1-step|topk:density=0.01,values=qsgd-ans,indices=rice"
    "topk1-step-fp16|topk:density=0.01,values=fp16,indices=rice"
)

TIMED=(
    allreduce
    quantize:bits=8
    topk:density=0.01,values=qsgd-ans,indices=rice
    diloco:sync_every=16
    diloco:sync_every=16+quantize:bits=8
    diloco:sync_every=16+quantize:bits=4
    diloco:sync_every=16,overlap=1+quantize:bits=4
    diloco:sync_every=32+quantize:bits=4,block=1024
    diloco:sync_every=16,fragments=4,overlap=1
    diloco:sync_every=16,fragments=4,overlap=1,merge=carry
    "diloco:sync_every=16,unsent=model+topk:density=0.01,$TOPK"
    "diloco:sync_every=16,unsent=model+topk:density=0.03,$TOPK"
)

case "${1:-}" in
    sim) sim "$2" "$3" "$4" ;;
    sims)
        for seed in 0 1; do
            for entry in "${SIMS[@]}"; do sim "${entry%%|*}" "$seed" "${entry#*|}"; done
        done ;;
    timing)
        # per-step times of the local phase (DiLoCo without its warm-up, 4 syncs of H = 16 measured),
        # of the warm-up's exchanges (allreduce, quantize:bits=8), and the compute-only floor; two rounds,
        # the method order reversed in the second, medians over rounds
        methods=()
        for method in "${TIMED[@]}"; do methods+=(--method "$method"); done
        python -m gradwire bench e2e --model gpt --optimizer adamw --batch-size 16 --workers 4 \
            --bandwidths "$2" --rounds 2 --steps 64 --warmup-steps 16 --out "$3" "${methods[@]}" ;;
    *) sed -n 2,8p "$0"; exit 2 ;;
esac
