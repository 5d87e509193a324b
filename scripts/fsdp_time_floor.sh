#!/bin/bash
# Where issue 20's step-time target (<= 0.5x plain FSDP2 at 100 Mbit/s) lies on this machine
# (docs/fsdp.md, "The floor under the step-time target"). Per round, one after another: the
# compute-only floor (4 ranks, forward+backward under DDP's no_sync, no communication at all),
# FSDP2 on loopback and FSDP2 on the emulated 100 Mbit/s cluster (plain FSDP2, int4 + int8
# gather, top-k 10% + int8 gather, plain again), then the floor again; even rounds run the
# cluster before loopback and the two compressed methods in reverse. Needs root (the cluster).
#
#     bash scripts/fsdp_time_floor.sh OUT_DIR [ROUNDS]     # default 3 rounds, about 2 minutes each
set -euo pipefail
out=${1:?usage: fsdp_time_floor.sh OUT_DIR [ROUNDS]}
rounds=${2:-3}
mkdir -p "$out"
common=(--model gpt --data pystdlib --workers 4 --steps 12 --warmup-steps 4 --batch-size 16 --optimizer adamw
        --no-eval)
int4=quantize:bits=4,gather=int8
topk=topk:density=0.1,values=fp16,indices=rice,gather=int8

# each reads the round's $round and $methods when called
floor() { python -m gradwire train "${common[@]}" --compute-only --method allreduce --json "$out/floor-r$round$1.json"; }
loopback() { python -m gradwire train --fsdp "${common[@]}" "${methods[@]}" --json "$out/loopback-r$round.json"; }
cluster() {
    python -m gradwire train --fsdp "${common[@]}" --cluster --bandwidth 100mbit "${methods[@]}" \
        --json "$out/cluster-r$round.json"
}

for round in $(seq 1 "$rounds"); do
    if (( round % 2 )); then methods=(--method allreduce --method $int4 --method $topk --method allreduce)
    else methods=(--method allreduce --method $topk --method $int4 --method allreduce); fi
    echo "== round $round" >&2
    floor a > /dev/null
    if (( round % 2 )); then loopback > /dev/null; cluster > /dev/null; else cluster > /dev/null; loopback > /dev/null; fi
    floor b > /dev/null
done

python - "$out" "$rounds" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print("round | compute-only floor (s/step, before, after) | FSDP2 loopback: plain; int4; top-k | "
      "FSDP2 100 Mbit/s: plain; int4; top-k (x the launch's mean plain)")
for r in range(1, rounds + 1):
    floors = [json.load(open(f"{out}/floor-r{r}{x}.json"))[0]["seconds_per_step"] for x in "ab"]
    cells = [f"{floors[0]:.3f}, {floors[1]:.3f}"]
    for kind in ("loopback", "cluster"):
        rows = json.load(open(f"{out}/{kind}-r{r}.json"))
        plain = [row["seconds_per_step"] for row in rows if row["method"] == "allreduce"]
        mean = sum(plain) / len(plain)
        by = {row["method"].split(":")[0]: row["seconds_per_step"] for row in rows if row["method"] != "allreduce"}
        cells.append(", ".join(f"{p:.3f}" for p in plain) + "; "
                     + "; ".join(f"{by[m]:.3f} ({by[m] / mean:.3f}x)" for m in ("quantize", "topk")))
    print(f"r{r} | " + " | ".join(cells))
EOF
