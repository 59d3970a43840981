"""experiments/profile_states.py on the CPU: each state kernel variant it would time (its
defaults, then each --options entry whose keywords it takes) lowers for CUDA to one Mosaic
GPU kernel; a variant that does not run is named and the run goes on; bad options are
refused by name; the comparison with the default is the largest difference per the largest
entry."""

from __future__ import annotations

import pytest

from tests.configs.test_probes import run

SCRIPT = "experiments/profile_states.py"
KERNELS = ("rows_to_state", "state_to_rows", "row_gradients", "state_to_rows_z",
           "row_gradients_z")
def expected_variants():
    """Each kernel's default, stages=2 for all, chunks_per_program=2 for rows_to_state."""
    names = []
    for kernel in KERNELS:
        names += [kernel, f"{kernel}@stages=2"]
        names += [f"{kernel}@chunks_per_program=2"] if kernel == "rows_to_state" else []
    return names


def test_every_variant_lowers_to_one_mosaic_gpu_kernel():
    done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512",
               "--options=stages=2,chunks_per_program=2")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines() if "lowers to" in line]
    assert [words[0] for words in lines] == expected_variants()
    assert all(words[3] == "1" for words in lines), done.stdout


def test_a_variant_that_does_not_run_is_named_and_the_others_still_timed():
    """On the CPU no Mosaic GPU kernel runs: every variant is reported with its error, and
    the run ends normally (on a GPU, a ring deeper than shared memory holds is such a
    variant)."""
    done = run(SCRIPT, "--t=1024", "--chunk=512", "--options=stages=2,chunks_per_program=2",
               "--reps=1")
    assert done.returncode == 0, done.stderr[-2000:]
    failed = [line.split()[0] for line in done.stdout.splitlines() if "does not run" in line]
    assert failed == expected_variants(), done.stdout


@pytest.mark.parametrize("options", ["stages=0", "stages", "stages=two", "1x=2"])
def test_options_that_are_not_keyword_positive_integers_are_refused(options):
    done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512", f"--options={options}")
    assert done.returncode != 0
    assert "--options: entries are 'name=N;...'" in done.stderr, done.stderr[-2000:]


def test_an_entry_runs_on_the_kernels_that_take_all_its_keywords():
    done = run(SCRIPT, "--lower", "--t=2048", "--chunk=512",
               "--options=stages=2;chunks_per_program=4")
    assert done.returncode == 0, done.stderr[-2000:]
    names = [line.split()[0] for line in done.stdout.splitlines() if "lowers to" in line]
    assert names == [KERNELS[0], f"{KERNELS[0]}@stages=2;chunks_per_program=4", *KERNELS[1:]]


def test_the_difference_from_the_default_is_per_its_largest_entry():
    """Imported in a process of its own (the script defines absl flags other scripts'
    tests define too)."""
    done = run("-c", """
import sys
sys.path.insert(0, "experiments")
import jax.numpy as jnp
import profile_states
want = (jnp.asarray([4.0, -8.0]), jnp.asarray([1.0, 0.5]))
got = (jnp.asarray([4.0, -7.0]), jnp.asarray([1.0, 0.5]))
print(profile_states.relative_difference(got, want), profile_states.relative_difference(want, want))
print(profile_states.parse_options(["", "stages=4;chunks_per_program=2"]))
""")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].split() == [str(1.0 / 8.0), "0.0"]
    assert lines[1] == "[{}, {'stages': 4, 'chunks_per_program': 2}]"
