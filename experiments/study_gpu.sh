#!/usr/bin/env bash
# Parts of the small-scale study (configs/study_small.py) in one call of a GPU machine that
# reaches no network, keeping what comes back small:
#
#   bash experiments/study_gpu.sh OUT PART [PART ...]
#
# PART: a part of configs/study_small.py (contexts, seeds, p4, gate_bias, clip), or
# 'contextwise': the held-out loss at every position to $CONTEXTWISE_LENGTH (16,384) of the
# runs of part $CONTEXTWISE_FROM (contexts) trained at $CONTEXTWISE_CONTEXT (1024),
# conformal-sympow's against the others'.
# Runs live in $RUNS (default /tmp/study_runs; resumed if there); OUT receives every run's
# config.json, metrics.jsonl, summary.json and the sweep and evaluation tables and figures,
# not the checkpoints. Needs the store in $DATA (default data/linux_small, built as in
# docs/experiments.md) and, where ml_collections is missing, its wheel in .whl/ (carried).
# Extra sweep-arg items for every part in $SWEEP_EXTRA (e.g. ',steps=200'; the CPU test
# uses ',runlocal,steps=2'). PACK=1 writes the same files as one OUT/study_files.tar.gz
# instead (the device tool returns files at most a few folders deep). The files are
# collected on every exit, a failed part's included.
set -euo pipefail
out=${1:?usage: study_gpu.sh OUT PART [PART ...]}
shift
[ $# -gt 0 ] || { echo "study_gpu.sh: name at least one part" >&2; exit 2; }
python=${PYTHON:-python3}
data=${DATA:-data/linux_small}
runs=${RUNS:-/tmp/study_runs}
[ -d "$data/train.zarr" ] || { echo "study_gpu.sh: DATA=$data holds no train.zarr" >&2; exit 2; }
if ! "$python" -c "import ml_collections" 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out" "$runs"
out=$(cd "$out" && pwd)
# The small files of every run (not the checkpoints), paths kept; also when a part fails.
collect() {
  local status=$?
  (cd "$runs" && find . -name checkpoints -prune -o -type f \
    \( -name '*.json' -o -name '*.jsonl' -o -name '*.csv' -o -name '*.png' \) -print0 |
    if [ "${PACK:-0}" = 1 ]; then
      tar czf "$out/study_files.tar.gz" --null -T -
    else
      xargs -0 -r cp --parents -t "$out"
    fi)
  exit "$status"
}
trap collect EXIT

for part in "$@"; do
  start=$(date +%s)
  if [ "$part" = contextwise ]; then
    ctx=${CONTEXTWISE_CONTEXT:-1024}
    trained=$(shopt -s nullglob; printf '%s\n' "$runs/${CONTEXTWISE_FROM:-contexts}"/*_ctx"$ctx")
    main=$(grep '/conformal_' <<< "$trained" | head -1 || true)
    others=$(grep -v '/conformal_' <<< "$trained" | paste -sd, - || true)
    [ -n "$main" ] || { echo "study_gpu.sh: no conformal run at context $ctx" >&2; exit 2; }
    "$python" experiments/evaluate.py --workdir "$main" ${others:+--compare "$others"} \
      --length "${CONTEXTWISE_LENGTH:-16384}" --num_windows "${CONTEXTWISE_WINDOWS:-64}" \
      --data_path "$data" --out "$runs/contextwise"
  else
    "$python" experiments/sweep.py --sweep "configs/study_small.py:part=$part${SWEEP_EXTRA:-}" \
      --workdir "$runs/$part" --set "data.path=$data" --noprogress
  fi
  echo "study part $part: $(( $(date +%s) - start )) s"
done

