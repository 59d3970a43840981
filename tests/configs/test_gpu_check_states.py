"""experiments/gpu_check.py's state-kernel check (experiments/state_checks.py) on the CPU,
with the kernels' plain-JAX definitions in their place (the kernels themselves need a
Hopper GPU): every row it names is computed and passes, so a GPU call spends no time on a
check that cannot run."""

from __future__ import annotations

from tests.configs.test_probes import run

SCRIPT = """
import sys
sys.path.insert(0, "experiments")
import functools
import numpy as np
import state_checks
from sympow.attention.mosaic_gpu import gram
from sympow.attention.mosaic_gpu import state_kernels as sk
from sympow.attention.mosaic_gpu import state_sums as ss
from sympow.attention.mosaic_gpu import state_references as sr

def without(*names):
    def wrap(fn):
        return lambda *args, **kw: fn(*args, **{k: v for k, v in kw.items() if k not in names})
    return wrap

ss.rows_to_state = without("chunks_per_program", "stages", "step_barriers")(
    sr.rows_to_state_reference)
sk.state_to_rows = without("chunks_per_program", "stages")(sr.state_to_rows_reference)
sk.row_gradients = without("chunks_per_program", "stages")(sr.row_gradients_reference)
gram.weighted_gram = functools.partial(gram.weighted_gram, interpret=True)
for scales in ("ordinary", "full"):
    rows = state_checks.check_state_kernels(np.random.default_rng(0), 1, 4, 2, 3, 128, 64, scales)
    print(scales, [(name, ok) for name, _, _, ok in rows])
"""


def test_every_row_of_the_state_check_runs_and_passes_on_the_definitions():
    done = run("-c", SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    names = ["S", "y", "g", "dx", "dls", "y_z", "den", "dx_z", "dls_z", "S_slots", "S_chunks",
             "S_one", "y_slots", "y_chunks", "dx_slots", "dx_chunks", "y_upper", "y_z_upper",
             "den_upper", "y_slots_upper", "y_packed", "y_z_packed", "den_packed",
             "y_slots_packed", "y_halves", "y_z_halves", "den_halves", "y_slots_halves",
             "y_square_halves", "dx_halves", "dls_halves", "S_whole_steps", "S_stored_upper",
             "S_stored_upper_whole_steps", "S_stored_upper_square_products", "y_stored_upper",
             "y_z_stored_upper", "den_stored_upper", "y_square_stored_upper",
             "g_stored_upper", "dx_z_stored_upper", "dls_z_stored_upper", "y_bf16_stored_upper",
             "S_formed", "S_formed_barriers", "y_z_formed", "den_formed", "y_bf16_formed",
             "dx_z_formed", "dls_z_formed", "gram"]
    for line, scales in zip(done.stdout.splitlines(), ("ordinary", "full"), strict=True):
        assert line == f"{scales} {[(name, True) for name in names]}", line
