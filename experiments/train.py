"""Train a sympow / softmax GPT: ``python experiments/train.py --config configs/X.py[:arg]
--workdir DIR [--config.key=value ...]``.

Resumes from the newest checkpoint in DIR. SIGTERM / Ctrl-C save a checkpoint and exit;
rerun the same command to continue. The logic lives in ``sympow.train.trainer``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # configs/ and an uninstalled sympow

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from sympow.train.compilation import define_cache_flag  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<name>.py[:arg]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, config)")
_MULTIHOST = flags.DEFINE_bool("multihost", False,
                               "call jax.distributed.initialize() (multi-process launch)")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")
_COMPILATION_CACHE = define_cache_flag()
flags.mark_flags_as_required(["config", "workdir"])

_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def main(argv):
    del argv
    from sympow.train.metrics import setup_logging

    setup_logging()
    from sympow.train.compilation import enable_compilation_cache

    enable_compilation_cache(_COMPILATION_CACHE.value)
    import jax

    if _MULTIHOST.value:
        jax.distributed.initialize()
    from sympow.train.trainer import train

    summary = train(_CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)
    if summary.get("interrupted"):
        sys.exit(_SIGNAL_EXIT.get(summary["interrupted"], 1))


if __name__ == "__main__":
    app.run(main)
