"""experiments/probe_grid_barrier.py on the CPU: its barrier kernels (barriers alone, in
both styles; weights streamed behind barriers; the same loads with none) and its one-row
products lower for CUDA to Mosaic GPU kernels here, the streamed one longer than the same
loads without barriers, the two styles different code; a product whose shapes the kernel
does not take, an unknown style and an unknown --styles entry are refused by name (its
refusal off a Hopper GPU: test_probes.py). In its own process: the script's absl flags
must not join this process's."""

from __future__ import annotations

import json

from tests.configs.test_probes import lowering_script, run

LOWER = lowering_script("probe_grid_barrier", """
def text(barrier, stream, layers, rows, style="counter"):
    fn = probe.probe_kernel(8, layers, rows, barrier=barrier, stream=stream, style=style)
    arg = jax.ShapeDtypeStruct((layers, 8, rows, probe.WIDTH), jnp.bfloat16)
    return fn.trace(arg).lower(lowering_platforms=("cuda",)).as_text()

kernels = {"barriers": (True, False, 4, 1), "streamed": (True, True, 3, 16),
           "loads_only": (False, True, 3, 16),
           "release_each": (True, False, 4, 1, "release_each")}
got = {name: {"mosaic": "mosaic_gpu" in t, "chars": len(t)}
       for name, t in ((name, text(*case)) for name, case in kernels.items())}
for k, n in ((768, 768), (768, 3072)):
    product = probe.one_row_product(k, n).trace(
        jax.ShapeDtypeStruct((1, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.bfloat16))
    text_of = product.lower(lowering_platforms=("cuda",)).as_text()
    got[f"product_{k}_{n}"] = {"mosaic": "mosaic_gpu" in text_of, "chars": len(text_of)}
got["refused"] = outcome(lambda: probe.one_row_product(3072, 768))
got["style_refused"] = outcome(lambda: probe.probe_kernel(8, 1, 1, barrier=True,
                                                          stream=False, style="tree"))
flags.FLAGS.styles = ["counter", "tree"]
try:
    got["styles_flag"] = probe.styles()
except SystemExit as error:
    got["styles_flag"] = str(error)
print(json.dumps(got))
""")


def test_the_kernels_lower_for_cuda_and_bad_shapes_and_styles_are_refused():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    refused, style_refused = got.pop("refused"), got.pop("style_refused")
    assert got.pop("styles_flag") == ("--styles: unknown ['tree']; choose from "
                                      "('counter', 'release_each')")
    assert all(kernel["mosaic"] for kernel in got.values()), got
    assert "K <= 1536; got K = 3072" in refused, refused
    assert "style must be one of ('counter', 'release_each'); got 'tree'" in style_refused
    # the barriers add code: the streamed kernel's module is longer than the loads alone
    assert got["streamed"]["chars"] > got["loads_only"]["chars"], got
    # the two barriers are different code: program 0's release loop is not in the counter
    assert got["release_each"]["chars"] != got["barriers"]["chars"], got
