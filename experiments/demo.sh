#!/usr/bin/env bash
# The README demo: train softmax and conformal-sympow quickstart GPTs (same size, same
# tokens) on the embedded Jane Austen corpus, evaluate both on held-out windows 8x longer
# than the training context, and plot the two contextwise curves in one figure.
#
#   bash experiments/demo.sh                  # -> runs/quickstart/contextwise.png
#   PYTHON=/path/to/python WORKDIR=runs/x bash experiments/demo.sh --config.num_train_steps=50
#
# Extra arguments go to both train.py runs. A few minutes on a 2-core CPU. Rerunning resumes
# (and, once training is complete, only re-evaluates); delete the workdir to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WORKDIR="${WORKDIR:-runs/quickstart}"
CONFIG="${CONFIG:-configs/quickstart.py}"
ARG="${ARG-bytes}"  # the byte-level corpus (fast on a CPU); ARG= for GPT-2 tokens

for variant in softmax conformal; do
  "$PYTHON" experiments/train.py --config "$CONFIG:$variant${ARG:+,$ARG}" \
    --workdir "$WORKDIR/$variant" "$@"
done
"$PYTHON" experiments/evaluate.py --workdir "$WORKDIR/conformal" --compare "$WORKDIR/softmax" \
  --out "$WORKDIR"
echo "demo: training curves in $WORKDIR/{softmax,conformal}/metrics.jsonl"
echo "demo: both contextwise curves in $WORKDIR/contextwise.png"
