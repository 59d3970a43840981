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
