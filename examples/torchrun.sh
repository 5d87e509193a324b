#!/usr/bin/env bash
# gradwire train under torchrun, on one node or many; usage: examples/torchrun.sh [gradwire train options]
# [readme: torchrun]
# on every node (HEAD: the first node's address); a failed worker restarts the whole job, up to
# 3 times, from the last checkpoint: model, optimizer and every rank's own residuals. A fixed
# collective resumes bit for bit; "auto" times its choice on real steps, so a resumed run may
# choose differently from an uninterrupted one
exec torchrun --nnodes "${NODES:-1}" --nproc_per_node "${PROCS:-2}" \
    --rdzv-backend c10d --rdzv-endpoint "${HEAD:-127.0.0.1}:${PORT:-29500}" --max-restarts 3 \
    -m gradwire train --method topk:density=0.01,values=fp16,indices=rice,collective=allgather \
    --checkpoint-dir "${CKPT:-checkpoints}" --checkpoint-every 100 "$@"
# [/readme]
