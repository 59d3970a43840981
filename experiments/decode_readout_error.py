"""Where the float32 decoding readout's error comes from, on the CPU (issue 14's check at
p = 4, d = 16, E = 128, ungated, docs/kernels.md):

  PYTHONPATH=. python3 experiments/decode_readout_error.py --seeds=40 --out=$DIR

Per seed (a prompt state of 12 tokens and 3 chained steps, `testing.check_decode`'s inputs
drawn from numpy's default_rng(seed)), each y's max error per max |y| of the float64
specification after the last step:

- spec: the float32 specification (`reference.recurrent_step`) as it is;
- state: its state, read out in float64 (what the state's rounding alone costs);
- readout: the float32 readout of that same state (what the readout's sums cost);
- tiles_float32 / tiles_compensated: the decoding kernel's order of operations emulated
  (each tile of `make_decode_plan(F).rows` features summed in float32, then the tiles'
  shares summed by float32 `jnp.sum` or by `numerics.compensated_sum`, as the kernel now
  does), on the float32 state.

Prints one line per seed and the max and median of each; writes decode_readout_error.json.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

_SEEDS = flags.DEFINE_integer("seeds", 40, "seeds 0 .. seeds - 1")
_OUT = flags.DEFINE_string("out", None, "directory for decode_readout_error.json")
CASE = dict(b=4, hq=8, hk=8, d=16, e=128, p=4)


def errors(seed: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.attention import reference, testing
    from sympow.attention.pallas.decode_kernel import make_decode_plan
    from sympow.attention.testing import max_err
    from sympow.embedding import sympow_embedding
    from sympow.numerics import compensated_sum

    b, hq, hk, d, e, p = (CASE[k] for k in ("b", "hq", "hk", "d", "e", "p"))
    rng = np.random.default_rng(seed)
    state = testing.decode_prompt_state(rng, b=b, hk=hk, d=d, e=e, p=p)
    with testing.float64_enabled():
        wide = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), state)
    for _ in range(3):
        q, k, v, _ = testing.decode_token(rng, b=b, hq=hq, hk=hk, d=d, e=e,
                                          dtype=jnp.float32, gated=False)
        state, y32 = reference.recurrent_step(state, q, k, v, None, p)
        with testing.float64_enabled():
            wide, y64 = reference.recurrent_step(
                wide, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), None, p)
    y64 = np.asarray(y64)
    phi_q = np.asarray(sympow_embedding(q, p)).reshape(b, hk, hq // hk, -1)  # float32
    s, z = np.asarray(state.s), np.asarray(state.z)
    f = z.shape[-1]

    def readout(num, den):
        return (num / den[..., None]).reshape(b, hq, e)

    def exact(x, y, spec):  # an einsum of float32 arrays in float64
        return np.einsum(spec, x.astype(np.float64), y.astype(np.float64))

    y_state = readout(exact(phi_q, s, "bhrf,bhfe->bhre"), exact(phi_q, z, "bhrf,bhf->bhr"))
    rows = make_decode_plan(f, hq // hk, e, interpret=True).rows

    def tile_shares(terms):  # [b, hk, r, F, ...] float32 -> [b, hk, r, tiles, ...]
        tiles = terms.reshape(*terms.shape[:3], f // rows, rows, *terms.shape[4:])
        share = tiles[:, :, :, :, 0]
        for row in range(1, rows):
            share = (share + tiles[:, :, :, :, row]).astype(np.float32)
        return share

    num_tiles = tile_shares((phi_q[..., None] * s[:, :, None]).astype(np.float32))
    den_tiles = tile_shares((phi_q * z[:, :, None]).astype(np.float32))
    plain = [np.asarray(jnp.sum(jnp.asarray(x), axis=3), np.float64)
             for x in (num_tiles, den_tiles)]
    kept = [np.asarray(compensated_sum(jnp.asarray(x), 3), np.float64)
            for x in (num_tiles, den_tiles)]
    scale = max_err(y64, 0.0)

    def err(y, want=y64):  # max |y - want| per max |y| of the float64 specification
        return max_err(y, want) / scale

    return {"spec": err(y32), "state": err(y_state), "readout": err(y32, y_state),
            "tiles_float32": err(readout(*plain)), "tiles_compensated": err(readout(*kept))}


def main(argv):
    del argv
    import numpy as np

    results = []
    for seed in range(_SEEDS.value):
        row = errors(seed)
        results.append({"seed": seed, **row})
        print(f"seed {seed:3d} " + "  ".join(f"{k} {v:.2e}" for k, v in row.items()), flush=True)
    summary = {stat: {k: float(fn([r[k] for r in results])) for k in results[0] if k != "seed"}
               for stat, fn in (("max", np.max), ("median", np.median))}
    for stat, row in summary.items():
        print(f"{stat:8s} " + "  ".join(f"{k} {v:.2e}" for k, v in row.items()))
    if _OUT.value:
        Path(_OUT.value).mkdir(parents=True, exist_ok=True)
        (Path(_OUT.value) / "decode_readout_error.json").write_text(json.dumps(
            {"case": {**CASE, "gated": False, "prompt": 12, "steps": 3}, "seeds": results,
             "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
