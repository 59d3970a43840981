"""experiments/profile_states.py on the CPU: each state kernel variant it would time (one per
ring depth) lowers for CUDA to one Mosaic GPU kernel, and a bad depth is refused by name."""

from __future__ import annotations

from tests.configs.test_probes import run

SCRIPT = "experiments/profile_states.py"
KERNELS = ("rows_to_state", "state_to_rows", "row_gradients", "state_to_rows_z",
           "row_gradients_z")


def test_every_kernel_lowers_at_each_ring_depth():
    done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512", "--stages=,2")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines() if "lowers to" in line]
    assert [words[0] for words in lines] == [*KERNELS, *(f"{k}@stages=2" for k in KERNELS)]
    assert all(words[3] == "1" for words in lines), done.stdout


def test_a_ring_depth_that_is_not_a_positive_integer_is_refused():
    done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512", "--stages=2,0")
    assert done.returncode != 0
    assert "--stages: ring depths are positive integers" in done.stderr, done.stderr[-2000:]


def test_a_variant_that_does_not_run_is_named_and_the_others_still_timed():
    """On the CPU no Mosaic GPU kernel runs: every variant is reported with its error, and
    the run ends normally (on a GPU, a ring deeper than shared memory holds is such a
    variant)."""
    done = run(SCRIPT, "--t=1024", "--chunk=512", "--stages=,2", "--reps=1")
    assert done.returncode == 0, done.stderr[-2000:]
    failed = [line.split()[0] for line in done.stdout.splitlines() if "does not run" in line]
    assert failed == [*KERNELS, *(f"{k}@stages=2" for k in KERNELS)], done.stdout
