#!/usr/bin/env bash
# The README demo: train the quickstart conformal-sympow GPT on the embedded Jane Austen corpus,
# evaluate its contextwise held-out loss, and plot it.
#
#   bash experiments/demo.sh                  # -> runs/quickstart/contextwise.png
#   PYTHON=/path/to/python WORKDIR=runs/x bash experiments/demo.sh --config.num_train_steps=50
#
# Extra arguments go to train.py. A few minutes on a 2-core CPU. Rerunning resumes (and, once
# training is complete, only re-evaluates); delete the workdir to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WORKDIR="${WORKDIR:-runs/quickstart}"
CONFIG="${CONFIG:-configs/quickstart.py}"

"$PYTHON" experiments/train.py --config "$CONFIG" --workdir "$WORKDIR" "$@"
"$PYTHON" experiments/evaluate.py --workdir "$WORKDIR"
echo "demo: training curve in $WORKDIR/metrics.jsonl (tensorboard --logdir $WORKDIR)"
echo "demo: contextwise loss plot in $WORKDIR/contextwise.png"
