"""JAX's persistent compilation cache for the command-line tools (train, evaluate, sweep).

A relaunch (a resume after preemption, a second run of the same config, an evaluation of
every checkpoint) compiles the same programs again; with the cache on, XLA reads the
executables it wrote the first time instead. The tools turn it on by default in
``~/.cache/sympow/jax`` (or $SYMPOW_COMPILATION_CACHE); ``--compilation_cache=`` turns it off.
Entries are keyed by the program, the jax/XLA versions and the device, so a changed model or
an upgrade compiles afresh rather than reusing a stale executable.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "SYMPOW_COMPILATION_CACHE"
DEFAULT_DIR = "~/.cache/sympow/jax"
MIN_COMPILE_SECONDS = 1.0  # programs that compile faster are not worth a disk entry


def default_cache_dir() -> str:
    return os.environ.get(ENV_VAR, DEFAULT_DIR)


def define_cache_flag():
    """The ``--compilation_cache`` flag of a command-line tool (call at import time)."""
    from absl import flags

    return flags.DEFINE_string(
        "compilation_cache", default_cache_dir(),
        f"directory of JAX's persistent compilation cache ('' = off; default ${ENV_VAR} or "
        f"{DEFAULT_DIR}): a relaunch reads the compiled programs instead of compiling again")


def enable_compilation_cache(directory: str | os.PathLike | None, *,
                             min_compile_seconds: float = MIN_COMPILE_SECONDS) -> Path | None:
    """Point JAX's persistent compilation cache at ``directory`` (created if missing);
    None or '' leaves it off. Returns the directory in use. A directory that cannot be
    created or written is a ValueError naming it (before any compilation)."""
    if not directory:
        return None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache={str(directory)!r}: cannot create the directory "
                         f"({e.strerror}); pass --compilation_cache= to turn the cache off") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"compilation_cache={str(directory)!r}: the directory is not "
                         "writable; pass --compilation_cache= to turn the cache off")
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path
