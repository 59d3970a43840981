"""Training, evaluation and sweeps for the sympow GPT (the logic behind ``experiments/*.py``).

- ``config``: load ``configs/*.py[:arg]``, apply ``key=value`` overrides, validate the
  result, the workdir copy.
- ``model``: a config's GPT as (graphdef, params, rest) for pure jitted steps.
- ``optim``: Adam(W) + gradient clipping + optional warmup/cosine.
- ``steps``: the train step (mean cross entropy, microbatching) and the contextwise loss.
- ``data``: device mesh and the deterministic loader as sharded global batches.
- ``checkpoint``: orbax checkpoints (params, optimizer state, step, RNG, data position);
  failed saves named, unreadable checkpoints set aside on resume.
- ``workdir``: one training process per workdir (a lock), the write probe.
- ``metrics``: ``metrics.jsonl``, TensorBoard event files, progress bar.
- ``trainer``: ``train(config, workdir)`` -- data parallel, exact resume, safe interruption,
  bad input and a diverging loss stopped with a named error.
- ``evaluation``: contextwise loss of checkpoints, CSV and PNG.
- ``tables``: the CSV format of evaluation and sweep tables.
- ``sweep``: train + evaluate across training contexts, the final-loss-vs-context figure.
- ``reports``: curves, the relative-loss table and loss vs context from run directories.
- ``plots``: the figure helpers these share (matplotlib on the Agg backend, on first use).

Imports of this package are light; the submodules pull in orbax, matplotlib and the layers.
"""

from __future__ import annotations

__all__ = ["checkpoint", "config", "data", "evaluation", "metrics", "model", "optim", "plots",
           "reports", "steps", "sweep", "tables", "trainer", "workdir"]
