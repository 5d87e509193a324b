#!/usr/bin/env bash
# Bytes per step of every method family, an earlier commit against this checkout (issue 16/17's
# "bytes per step unchanged"): 2 workers, cnn on synthetic data, 6 steps (2 untimed), loopback.
#
#   scripts/bytes_compare.sh [REF]      REF defaults to fb4dc87 (before wave 3)
#
# Prints one line per method: REF's bytes per step, this checkout's, their ratio. QSGD values
# round stochastically (seed=None), so their bytes vary by a few percent between any two runs.
set -euo pipefail
cd "$(dirname "$0")/.."
ref="${1:-fb4dc87}"
old="$(mktemp -d)"
trap 'git worktree remove --force "$old" >/dev/null 2>&1 || rm -rf "$old"' EXIT
git worktree add -f --detach "$old" "$ref" >/dev/null 2>&1
methods=(--method allreduce --method "topk:density=0.01,values=fp16,indices=rice,collective=allgather"
         --method "topk:density=0.01,collective=sparse-allreduce" --method "randomblock:density=0.01,values=fp16"
         --method "sampled-topk:density=0.01,values=fp16,indices=eliasfano,collective=allgather"
         --method "sampled-topk:density=0.01,values=qsgd,indices=eliasfano,collective=allgather"
         --method "topk:density=0.01,scope=global,collective=allgather"
         --method "randomk:density=0.01,collective=allreduce")
for tree in "$old" "$PWD"; do
    (cd "$tree" && PYTHONPATH="$tree/src" OMP_NUM_THREADS=1 python -m gradwire train --workers 2 --model cnn \
        --data synthetic --steps 6 --warmup-steps 2 --no-eval "${methods[@]}" --json "$tree/.bytes.json" >/dev/null)
done
python - "$old/.bytes.json" "$PWD/.bytes.json" "$ref" <<'PY'
import json, sys
def rows(path):
    data = json.load(open(path))
    data = data.get("methods", data) if isinstance(data, dict) else data
    return {r["method"]: r["bytes_per_step"] for r in (data if isinstance(data, list) else data.values())}
old, new = rows(sys.argv[1]), rows(sys.argv[2])
print(f"{'method':72s} {sys.argv[3]:>10s} {'now':>10s}  ratio")
for method, before in old.items():
    print(f"{method:72s} {before:10,.0f} {new[method]:10,.0f}  {new[method] / before:.4f}")
PY
rm -f .bytes.json
