"""experiments/profile_states.py on the CPU: each state kernel variant it would time (its
defaults, then each --options entry whose keywords it takes) lowers for CUDA to one Mosaic
GPU kernel; a variant that cannot run is named and the run goes on; bad options and
options no kernel takes are refused by name; the comparison with the default is the
largest difference per the largest entry."""

from __future__ import annotations

import pytest

from tests.configs.test_probes import run

SCRIPT = "experiments/profile_states.py"
KERNELS = ("rows_to_state", "state_to_rows", "row_gradients", "state_to_rows_z",
           "row_gradients_z")


def expected_variants():
    """Each kernel's default, stages=2 for all, chunks_per_program=2 for those without the
    normalizer (with it, state_to_rows and row_gradients take one chunk a program and
    refuse more: named as not lowering, so not listed here)."""
    names = []
    for kernel in KERNELS:
        names += [kernel, f"{kernel}@stages=2"]
        names += [f"{kernel}@chunks_per_program=2"] if not kernel.endswith("_z") else []
    return names


def test_every_variant_lowers_to_one_mosaic_gpu_kernel():
    done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512",
               "--options=stages=2,chunks_per_program=2")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines() if "lowers to" in line]
    assert [words[0] for words in lines] == expected_variants()
    assert all(words[3] == "1" for words in lines), done.stdout


def test_a_variant_that_cannot_run_is_named_and_the_run_goes_on():
    """chunks_per_program=3 does not divide the 2 chunks of T = 1024: that variant is named
    with its error, in a timed run (anywhere: on a CPU no variant runs, on a Hopper GPU the
    others are timed) and in a lowering run, and both runs end normally."""
    options = "--options=stages=2,chunks_per_program=3"
    for flags in (("--reps=1",), ("--lower",)):
        done = run(SCRIPT, "--t=1024", "--chunk=512", options, *flags)
        assert done.returncode == 0, done.stderr[-2000:]
        failed = [line for line in done.stdout.splitlines()
                  if line.startswith("rows_to_state@chunks_per_program=3")]
        assert len(failed) == 1 and "ValueError: chunks_per_program=3 must divide the 2" in \
            failed[0], done.stdout


def test_an_entry_no_kernel_takes_is_refused():
    for entry in ("stage=4", "kv_heads=2"):  # a typo; a keyword the script itself sets
        done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512", f"--options={entry}")
        assert done.returncode != 0
        assert "--options: no kernel takes" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("options", ["stages=0", "stages", "stages=two", "1x=2"])
def test_options_that_are_not_keyword_positive_integers_are_refused(options):
    done = run(SCRIPT, "--lower", "--t=1024", "--chunk=512", f"--options={options}")
    assert done.returncode != 0
    assert "--options: entries are 'name=N;...'" in done.stderr, done.stderr[-2000:]


def test_an_entry_runs_on_the_kernels_that_take_all_its_keywords():
    done = run(SCRIPT, "--lower", "--t=2048", "--chunk=512",
               "--options=stages=2;chunks_per_program=4")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    names = [line.split()[0] for line in lines if "lowers to" in line]
    both = "@stages=2;chunks_per_program=4"
    assert names == [KERNELS[0], KERNELS[0] + both, KERNELS[1], KERNELS[1] + both,
                     KERNELS[2], KERNELS[2] + both, *KERNELS[3:]]
    refused = [line.split()[0] for line in lines if "does not lower" in line]
    assert refused == [KERNELS[3] + both, KERNELS[4] + both], done.stdout


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


def test_the_arguments_have_the_tiers_symmetries():
    """A state drawn for the kernels is symmetric in its (i, j) and col is the rows x^T
    (or xt itself), as in the tier, where state_to_rows' `upper` gives the square sum."""
    done = run("-c", """
import sys
sys.path.insert(0, "experiments")
import jax, jax.numpy as jnp, numpy as np
import profile_states
bf16 = jnp.bfloat16
x, col, s = profile_states.arguments(
    [((1, 2, 2, 8, 64), bf16), ((1, 2, 2, 64, 8), bf16), ((1, 2, 2, 4096, 16), bf16)],
    jax.random.PRNGKey(0), (0, 1))
square = np.asarray(s, np.float32).reshape(1, 2, 2, 64, 64, 16)
print(np.array_equal(square, np.swapaxes(square, 3, 4)), bool(np.any(square)))
print(np.array_equal(np.asarray(col), np.swapaxes(np.asarray(x), -1, -2)))
xt, col2, _ = profile_states.arguments(
    [((1, 2, 2, 64, 8), bf16), ((1, 2, 2, 64, 8), bf16), ((1, 2, 2, 8, 16), bf16)],
    jax.random.PRNGKey(1), (0, 1))
print(np.array_equal(np.asarray(col2), np.asarray(xt)))
""")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["True True", "True", "True"]


def test_the_useful_rate_counts_the_distinct_features_against_the_matmul_peak():
    """2 H T (64 * 65 / 2) 64 flop in the kernel's time: at T = 65,536, H = 8 and 417.1 us,
    2 * 8 * 65536 * 2080 * 64 / 417.1e-6 s = 334.66 TFLOP/s, 42.6 % of 786 (the sixteenth
    session's rows_to_state in docs/kernels.md), whatever layout the kernel computes."""
    done = run("-c", """
import sys
sys.path.insert(0, "experiments")
import profile_states
print(profile_states.useful_rate(417.1, {"matmul_kernel_tflops": 786.0}, heads=8, t=65536))
print(profile_states.useful_rate(417.1, None, heads=8, t=65536))
print(profile_states.useful_rate(417.1 / 2, None, heads=8, t=2 * 65536))
""")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["  useful  334.7 TFLOP/s = 42.6 % of the peak",
                                        "  useful  334.7 TFLOP/s",
                                        "  useful 1338.6 TFLOP/s"]


def test_an_upper_variant_is_compared_with_the_defaults_stored_entries():
    """rows_to_state@upper=1 returns the upper layout's four arrays where its default returns
    the square state: the comparison takes the default's entries the upper layout stores
    (the same sums: 0), and a changed stored entry shows; outputs of one form pass as is."""
    done = run("-c", """
import sys
sys.path.insert(0, "experiments")
import jax, jax.numpy as jnp
import profile_states
from sympow.attention.mosaic_gpu.state_references import upper_arrays
square = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 3, 4096, 8))
upper = upper_arrays(square)
print(profile_states.relative_difference(upper, profile_states.stored_like(upper, square)))
changed = (upper[0].at[0, 0, 0, 0, 0, 0].add(1e3),) + upper[1:]
stored = profile_states.stored_like
print(profile_states.relative_difference(changed, stored(changed, square)) > 0.1)
print(stored(square, square) is square, stored(upper, upper) is upper)
""")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["0.0", "True", "True True"]
