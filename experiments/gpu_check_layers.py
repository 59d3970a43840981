"""The GPU checks of the layers' own kernels (sympow.layers): `gpu_check.py --only=rotary`
and `--only=norm` run these. Each check returns rows (output, err, note, ok)."""

import functools

# --only=rotary: (b, t, h, hk, d) of rotary_kernel.rotate, both dtypes: GPT-2 small's queries
# at 65,536 tokens, grouped heads with rows not a multiple of the block, the widest heads.
ROTARY_CASES = [(1, 65536, 12, 12, 64), (2, 1000, 6, 2, 64), (3, 45, 4, 4, 128),
                (1, 300, 2, 1, 16)]


def check_rotary(rng, dtype: str, b: int, t: int, h: int, hk: int, d: int):
    """Rows (output, err, note, ok) of the learned-rotary kernels against their
    specification: x' and the cotangents of x and mu, relative L2 errors, in both layouts;
    then with a bias [H, D] added as the rows load (outputs ending in _b; its cotangent
    dbias). mu grows as the layers' does (beta in (0, 2) summed over the tokens, up to ~1e5
    at 65,536)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.layers import rotary_kernel

    x = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    mu = jnp.asarray(np.cumsum(rng.uniform(0, 2, (b, t, hk)), axis=1), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    bias = jnp.asarray(rng.standard_normal((h, d)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(fn, x, mu, dy, bias):
        if bias is None:
            y, vjp = jax.vjp(lambda x, mu: fn(x, mu, base=65536.0), x, mu)
        else:
            y, vjp = jax.vjp(lambda x, mu, bias: fn(x, mu, base=65536.0, bias=bias), x, mu,
                             bias)
        return (y, *vjp(dy))

    # bf16 outputs: the same float32 rotation rounded once (cos and sin may differ in an
    # ulp); float32 and every mu cotangent: float32 sums in another order. dbias sums the
    # dx returned (in x's dtype): its error is at most that rounding, <= 2^-8 |dx| a term
    # in bf16, so its row reports max |error| / (2^-8 sum |dx|) (float32: 1e-5 for 2^-8).
    tols = (4e-3, 4e-3, 1e-4, 1.0) if dtype == "bfloat16" else (1e-5, 1e-5, 1e-4, 1.0)
    unit = 2.0 ** -8 if dtype == "bfloat16" else 1e-5
    rows = []
    for shift in (None, bias):
        want = run(rotary_kernel.rotate_reference, x, mu, dy, shift)
        for layout in rotary_kernel.LAYOUTS:  # outputs of the 'heads' layout end in _h
            got = run(functools.partial(rotary_kernel.rotate, layout=layout), x, mu, dy, shift)
            suffix = "_h" * (layout == "heads") + "_b" * (shift is not None)
            names = ("y", "dx", "dmu", "dbias")[:len(got)]
            for name, a, c, tol in zip(names, got, want, tols[:len(got)], strict=True):
                a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
                err = float(np.linalg.norm(a - c) / max(np.linalg.norm(c), 1e-30))
                if name == "dbias":
                    bound = unit * np.abs(np.asarray(want[1], np.float64)).sum(axis=(0, 1))
                    err = float(np.max(np.abs(a - c) / bound))
                rows.append((name + suffix, err, f"tol {tol:g}",
                             bool(np.all(np.isfinite(a))) and err <= tol))
    return rows


# --only=norm: (rows, C) of norm_kernel.add_layer_norm, both dtypes: GPT-2 small's 65,536
# tokens, rows off the kernels' 128-row blocks, one column tile.
NORM_CASES = [(65536, 768), (1033, 768), (300, 64), (45, 128)]


def check_norm(rng, dtype: str, n: int, c: int):
    """Rows (output, err, note, ok) of the residual add + LayerNorm kernels: s, y and the
    cotangents of x (= delta's) and the bias against the specification as XLA runs it
    (relative L2; dbias as max |error| / (2^-7 sum |dx|) per column (bf16; 1e-5 float32):
    the kernel rounds dx once, autodiff of the specification twice), the scale's and the
    shift's against float64 sums from the kernels' s (in bf16 XLA's compiled specification
    normalizes the unrounded float32 sum, not s: its dscale differs from the float64 one
    by ~2^-9)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.layers import norm_kernel

    x = jnp.asarray(3 * rng.standard_normal((n, c)), dtype)
    delta = jnp.asarray(0.5 * rng.standard_normal((n, c)), dtype)
    bias, scale, shift = (jnp.asarray(rng.standard_normal(c), jnp.float32) for _ in range(3))
    ds, dy = (jnp.asarray(rng.standard_normal((n, c)), dtype) for _ in range(2))

    @functools.partial(jax.jit, static_argnums=0)
    def run(impl, *args):
        outs, vjp = jax.vjp(
            lambda *a: norm_kernel.add_layer_norm(*a, eps=1e-5, impl=impl), *args)
        return (*outs, *vjp((ds, dy)))

    got = [np.asarray(a, np.float64) for a in run("pallas", x, delta, bias, scale, shift)]
    want = [np.asarray(a, np.float64) for a in run("xla", x, delta, bias, scale, shift)]
    s64, dy64 = got[0], np.asarray(dy, np.float64)
    mean = s64.mean(axis=1, keepdims=True)
    var = np.maximum((s64 * s64).mean(axis=1, keepdims=True) - mean * mean, 0)
    want[5] = (dy64 * (s64 - mean) / np.sqrt(var + 1e-5)).sum(axis=0)  # dscale
    want[6] = dy64.sum(axis=0)  # dshift
    bf16 = dtype == "bfloat16"
    tols = {"s": 1e-6, "y": 4e-3 if bf16 else 1e-6, "dx": 4e-3 if bf16 else 1e-5,
            "ddelta": 4e-3 if bf16 else 1e-5, "dbias": 1.0, "dscale": 1e-5, "dshift": 1e-5}
    rows = []
    for name, a, b in zip(tols, got, want, strict=True):
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        if name == "dbias":
            bound = (2.0 ** -7 if bf16 else 1e-5) * np.abs(want[2]).sum(axis=0)
            err = float(np.max(np.abs(a - b) / bound))
        note = f"tol {tols[name]:g}" + (" vs float64" if name in ("dscale", "dshift") else "")
        rows.append((name, err, note, bool(np.all(np.isfinite(a))) and err <= tols[name]))
    return rows
