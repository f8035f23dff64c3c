#!/usr/bin/env bash
# A model's training step (examples/pytorch/train_qat.py) with this tree's qbl against another
# build of it, in one call on one GPU: the two packages built side by side, then train_qat
# processes of the two taking turns (base, new, new, base, base, new, ...), each timing the
# reference module and qbl in its own interleaved rounds. Every process writes its JSON; the
# summary gives, per precision, mode and variant, each build's median step time, its ratio to the
# compiled reference of the same process, and the peak memory.
#
#   tools/ab_train.sh BASE_SRC [OUT_DIR]
#
# BASE_SRC: a source tree of the other build, its python/ and include/ (for example
# `git archive <commit> python include | tar -x -C BASE_SRC`). OUT_DIR: default build-ab.
# Environment: TRAIN_ARGS (train_qat's arguments; default: D = 2048, bf16 and autocast, eager and
# compiled, reference / qbl / qbl_recompute, 5 rounds of 10 steps, no loss curves), PAIRS (process
# pairs, default 3), DEADLINE_S (no process starts later than this many seconds after the start,
# default 480), PROC_S (each process's limit, default 150), JOBS (build jobs per package, default
# 8), PYTHON (default python3). Each build has its own Inductor cache under OUT_DIR, kept between
# calls on the same machine.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] && [ -d "$1/python" ] && [ -d "$1/include" ] ||
  { echo "usage: $0 BASE_SRC [OUT_DIR]  (BASE_SRC holds python/ and include/)" >&2; exit 2; }
base_src=$(cd "$1" && pwd)
out=${2:-build-ab}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PYTHON=${PYTHON:-python3}
PAIRS=${PAIRS:-3}
DEADLINE_S=${DEADLINE_S:-480}
PROC_S=${PROC_S:-150}
JOBS=${JOBS:-8}
read -r -a train_args <<<"${TRAIN_ARGS:---d 2048 --precision bf16,autocast --modes eager,compile --variants reference,qbl,qbl_recompute --rounds 5 --round-steps 10 --curve-precisions none}"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

build() {  # build NAME SRC
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=$JOBS \
    "$PYTHON" -m pip install --no-build-isolation --no-deps --quiet --target "$out/pkg_$1" "$2/python" \
    >"$out/build_$1.log" 2>&1
  echo "package $1: rc $? at $(elapsed) s"
}
build new "$PWD" &
build base "$base_src" &
wait

order=()
for ((i = 0; i < PAIRS; ++i)); do
  if ((i % 2 == 0)); then order+=("base" "new"); else order+=("new" "base"); fi
done
n=0
for v in "${order[@]}"; do
  n=$((n + 1))
  if [ "$(elapsed)" -ge "$DEADLINE_S" ]; then
    echo "process $n ($v): not started, past ${DEADLINE_S} s"
    continue
  fi
  PYTHONPATH="$out/pkg_$v${PYTHONPATH:+:$PYTHONPATH}" TORCHINDUCTOR_CACHE_DIR="$out/inductor_$v" \
    PYTHONUNBUFFERED=1 timeout "$PROC_S" "$PYTHON" examples/pytorch/train_qat.py "${train_args[@]}" \
    --plot '' --json "$out/$v$n.json" >"$out/$v$n.log" 2>&1
  echo "process $n ($v): rc $? at $(elapsed) s"
done

"$PYTHON" - "$out" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    build = "new" if os.path.basename(path).startswith("new") else "base"
    d = json.load(open(path))
    ref = {(t["precision"], t["d"]): t["gpu_ms_median"] for t in d["timings"]
           if t["variant"] == "reference" and t["mode"] == "compile"}
    for t in d["timings"]:
        key = (t["d"], t["precision"], t["mode"], t["variant"])
        r = rows.setdefault(key, {"new": [], "base": []})
        r[build].append((t["gpu_ms_median"], ref.get((t["precision"], t["d"])), t["peak_mib_median"]))
print("| D | precision | mode | variant | new ms | base ms | new/base | new: compiled ref / it "
      "| base: compiled ref / it | new peak MiB | base peak MiB | processes |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows):
    r = rows[key]
    med = {b: statistics.median(x[0] for x in r[b]) if r[b] else float("nan") for b in r}
    speed = {b: statistics.median(x[1] / x[0] for x in r[b] if x[1]) if r[b] else float("nan")
             for b in r}
    peak = {b: max(x[2] for x in r[b]) if r[b] else float("nan") for b in r}
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {med['new']:.2f} | {med['base']:.2f} | "
          f"{med['new'] / med['base']:.3f} | {speed['new']:.3f} | {speed['base']:.3f} | "
          f"{peak['new']:.0f} | {peak['base']:.0f} | {len(r['new'])} + {len(r['base'])} |")
EOF
