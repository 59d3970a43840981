"""sympow.train.compilation: the persistent compilation cache the command-line tools turn on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sympow.train import compilation
from tests.train.helpers import ROOT
from tests.train.test_trainer import cli

# A fresh process that points the cache at argv[1], compiles one program and prints how many
# programs it read from the cache and how many it compiled and wrote.
PROGRAM = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax import monitoring
    from sympow.train.compilation import enable_compilation_cache

    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    enable_compilation_cache(sys.argv[1], min_compile_seconds=0)
    jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((32, 32))))
    print(events.count("/jax/compilation_cache/cache_hits"),
          events.count("/jax/compilation_cache/cache_misses"))
""")


def run_program(cache_dir) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(cache_dir)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    hits, misses = out.split()
    return int(hits), int(misses)


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    hits, misses = run_program(cache)
    assert hits == 0 and misses >= 1
    assert any(cache.iterdir())
    hits, misses = run_program(cache)
    assert hits >= 1 and misses == 0


def test_off_when_empty():
    assert compilation.enable_compilation_cache("") is None
    assert compilation.enable_compilation_cache(None) is None


def test_an_unwritable_directory_is_named(tmp_path, make_read_only):
    locked = make_read_only(tmp_path / "locked")
    for bad in (locked, locked / "cache"):
        with pytest.raises(ValueError, match=rf"compilation_cache='{bad}'.*--compilation_cache="):
            compilation.enable_compilation_cache(bad)


def test_the_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(compilation.ENV_VAR, "/somewhere/else")
    assert compilation.default_cache_dir() == "/somewhere/else"
    monkeypatch.delenv(compilation.ENV_VAR)
    assert compilation.default_cache_dir() == compilation.DEFAULT_DIR


def test_train_py_names_an_unwritable_cache_before_training(tmp_path, make_read_only):
    locked = make_read_only(tmp_path / "locked")
    proc = cli(f"{ROOT}/configs/quickstart.py:runlocal", ["num_train_steps=1"],
               tmp_path / "run", flags=[f"--compilation_cache={locked}"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert f"ValueError: compilation_cache='{locked}'" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
