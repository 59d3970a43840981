"""The Hopper state kernels against their plain-JAX definitions, on a GPU: the rows of
`gpu_check.py --only=primitives --cases=states` (that script's check, kept here beside it).

  PYTHONPATH=. python3 experiments/gpu_check.py --only=primitives --cases=states
"""


def check_state_kernels(rng, b, hq, hk, n, c, e, scales):
    """Rows (output, err, note, ok): each Hopper state kernel against its definition in
    float32 XLA (state_references) on the same bf16 inputs: rows_to_state (S),
    state_to_rows (y = phi(u) S), its transposed form (g) and row_gradients (dx = 2 g in
    bf16, dls its row sums against x); then with the normalizer's quadratic form (Z a sum
    of phi of 16 random rows per chunk, in bf16 parts; weights w = c e^(2 ls) with random
    c): state_to_rows' y and den = w x^T Z x, row_gradients' dx and dls; then the slotted
    layout of the in-place prefix sum: S written at slots 1..N of N + 1 (slot_offset=1),
    also by one program walking all N chunks (chunks_per_program=N) and by one program a
    chunk (the default walks up to 4), y and dx read from there (slot 0 NaN: a read of it
    fails the row), each also by one program walking all N chunks; then state_to_rows over
    the upper blocks of S (`upper`, against its definition: the square sum with feature
    (i, j) weighted by `state_references.upper_weights`) for y, y and den with the normalizer,
    y from the slots, each again with the short blocks packed (`packed`), and again with
    each step's blocks in two halves (`pipelined`: the tier's y and da; `_halves`); the
    square y and row_gradients in halves; rows_to_state issuing whole steps
    (`pipelined=False`; its default issues halves); then the state stored in the upper
    layout (`state_walks.upper_shapes`): rows_to_state writing it (in halves, in whole
    steps, and with the square products whose upper rows it stores), state_to_rows reading
    it over the upper blocks as the tier does (y, y and den with the normalizer) and over
    whole blocks (their lower rows from the mirrors: y, g), row_gradients (dx, dls with
    the normalizer), each against its definition on the same stored entries
    (`_stored_upper`), and y rounded to bf16 in the kernel as the tier's da is
    (`y_bf16_stored_upper`); then the tier's calls again with col formed in the kernels
    from x^T and e^(2 ls) (`column_forms.Columns`, `_formed`: the same bf16 col, so the
    same definitions); last the normalizer sums (`gram.weighted_gram`, a Triton kernel)
    against float64, float32-accurate (`check_gram`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.attention.mosaic_gpu import column_forms
    from sympow.attention.mosaic_gpu import state_kernels as sk
    from sympow.attention.mosaic_gpu import state_references as sr
    from sympow.attention.mosaic_gpu import state_sums as ss
    from sympow.attention.mosaic_gpu.states import columns, z_parts

    d = sk.DIM
    x = jnp.asarray(rng.normal(size=(b, hq, n, c, d)) / d ** 0.5, jnp.bfloat16)
    a = jnp.asarray(rng.normal(size=(b, hq, n, c, e)), jnp.bfloat16)
    ls = (rng.uniform(-2.0, 0.0, size=(b, hq, n, c)) if scales == "ordinary"
          else np.full((b, hq, n, c), -5000.0))
    col = columns(x, jnp.asarray(ls, jnp.float32))
    xt = jnp.swapaxes(x, -1, -2)
    s = sr.rows_to_state_reference(xt, col, a, kv_heads=hk)
    r = rng.normal(size=(b, hk, n, 16, d))
    z = jnp.asarray(np.einsum("bhnri,bhnrj->bhnij", r, r).reshape(b, hk, n, d * d), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(b, hq, n, c)) * np.exp(2.0 * ls), jnp.float32)

    tier = {"upper": True, "packed": True, "pipelined": True}

    @jax.jit
    def run(xt, col, a, x, s, z, weights, w):
        norm = sk.Normalizer(z_parts(z), weights)
        formed = column_forms.Columns(xt, w)
        slotted = jnp.concatenate([jnp.full_like(s[:, :, :1], jnp.nan), s], axis=2)
        stored = sr.upper_arrays(slotted)
        return [(ss.rows_to_state(xt, col, a, kv_heads=hk),
                 sr.rows_to_state_reference(xt, col, a, kv_heads=hk)),
                (sk.state_to_rows(x, col, s, transposed=False),
                 sr.state_to_rows_reference(x, col, s, transposed=False)),
                (sk.state_to_rows(a, col, s, transposed=True),
                 sr.state_to_rows_reference(a, col, s, transposed=True)),
                *zip(sk.row_gradients(a, x, col, s), sr.row_gradients_reference(a, x, col, s),
                     strict=True),
                *zip(sk.state_to_rows(x, col, s, transposed=False, normalizer=norm),
                     sr.state_to_rows_reference(x, col, s, transposed=False, normalizer=norm),
                     strict=True),
                *zip(sk.row_gradients(a, x, col, s, normalizer=norm),
                     sr.row_gradients_reference(a, x, col, s, normalizer=norm), strict=True),
                (ss.rows_to_state(xt, col, a, kv_heads=hk, slots=n + 1, slot_offset=1)[:, :, 1:],
                 sr.rows_to_state_reference(xt, col, a, kv_heads=hk)),
                *((ss.rows_to_state(xt, col, a, kv_heads=hk, slots=n + 1, slot_offset=1,
                                    chunks_per_program=k)[:, :, 1:],
                   sr.rows_to_state_reference(xt, col, a, kv_heads=hk)) for k in (n, 1)),
                *((sk.state_to_rows(x, col, slotted, transposed=False, slot_offset=1,
                                    chunks_per_program=k),
                   sr.state_to_rows_reference(x, col, s, transposed=False)) for k in (1, n)),
                *((sk.row_gradients(a, x, col, slotted, slot_offset=1, chunks_per_program=k)[0],
                   sr.row_gradients_reference(a, x, col, s)[0]) for k in (1, n)),
                # over the upper blocks of S (symmetric but for col's bf16 rounding)
                (sk.state_to_rows(x, col, s, transposed=False, upper=True),
                 sr.state_to_rows_reference(x, col, s, transposed=False, upper=True)),
                *zip(sk.state_to_rows(x, col, s, transposed=False, normalizer=norm, upper=True),
                     sr.state_to_rows_reference(x, col, s, transposed=False, normalizer=norm,
                                                upper=True), strict=True),
                (sk.state_to_rows(x, col, slotted, transposed=False, slot_offset=1, upper=True),
                 sr.state_to_rows_reference(x, col, s, transposed=False, upper=True)),
                # ... with the short blocks packed into fewer ring steps
                (sk.state_to_rows(x, col, s, transposed=False, upper=True, packed=True),
                 sr.state_to_rows_reference(x, col, s, transposed=False, upper=True)),
                *zip(sk.state_to_rows(x, col, s, transposed=False, normalizer=norm, upper=True,
                                      packed=True),
                     sr.state_to_rows_reference(x, col, s, transposed=False, normalizer=norm,
                                                upper=True), strict=True),
                (sk.state_to_rows(x, col, slotted, transposed=False, slot_offset=1, upper=True,
                                  packed=True),
                 sr.state_to_rows_reference(x, col, s, transposed=False, upper=True)),
                # ... and each step's blocks in two halves (the tier's y and da)
                *((sk.state_to_rows(x, col, s, transposed=False, **tier),
                   sr.state_to_rows_reference(x, col, s, transposed=False, upper=True)),
                  *zip(sk.state_to_rows(x, col, s, transposed=False, normalizer=norm, **tier),
                       sr.state_to_rows_reference(x, col, s, transposed=False,
                                                  normalizer=norm, upper=True), strict=True),
                  (sk.state_to_rows(x, col, slotted, transposed=False, slot_offset=1, **tier),
                   sr.state_to_rows_reference(x, col, s, transposed=False, upper=True))),
                # the square products with their steps in halves; rows_to_state without
                (sk.state_to_rows(x, col, s, transposed=False, pipelined=True),
                 sr.state_to_rows_reference(x, col, s, transposed=False)),
                *zip(sk.row_gradients(a, x, col, s, pipelined=True),
                     sr.row_gradients_reference(a, x, col, s), strict=True),
                (ss.rows_to_state(xt, col, a, kv_heads=hk, pipelined=False),
                 sr.rows_to_state_reference(xt, col, a, kv_heads=hk)),
                # the state stored in the upper layout (slot 0 NaN, as above), written and
                # read: y as the tier takes it, the whole blocks with their mirrors
                (tuple(u[:, :, 1:] for u in ss.rows_to_state(
                    xt, col, a, kv_heads=hk, slots=n + 1, slot_offset=1, upper=True)),
                 sr.upper_arrays(s)),
                # ... its products over the stored rows only (by_groups, E = 64) in whole
                # steps, and the square products of which it stores the upper rows
                (ss.rows_to_state(xt, col, a, kv_heads=hk, upper=True, pipelined=False),
                 sr.upper_arrays(s)),
                (ss.rows_to_state(xt, col, a, kv_heads=hk, upper=True, square_products=True),
                 sr.upper_arrays(s)),
                (sk.state_to_rows(x, col, stored, transposed=False, slot_offset=1, **tier),
                 sr.state_to_rows_reference(x, col, stored, transposed=False, slot_offset=1,
                                            upper=True)),
                *zip(sk.state_to_rows(x, col, stored, transposed=False, slot_offset=1,
                                      normalizer=norm, **tier),
                     sr.state_to_rows_reference(x, col, stored, transposed=False, slot_offset=1,
                                                normalizer=norm, upper=True), strict=True),
                (sk.state_to_rows(x, col, stored, transposed=False, slot_offset=1),
                 sr.state_to_rows_reference(x, col, stored, transposed=False, slot_offset=1)),
                (sk.state_to_rows(a, col, stored, transposed=True, slot_offset=1),
                 sr.state_to_rows_reference(a, col, stored, transposed=True, slot_offset=1)),
                *zip(sk.row_gradients(a, x, col, stored, slot_offset=1, normalizer=norm),
                     sr.row_gradients_reference(a, x, col, stored, slot_offset=1,
                                                normalizer=norm), strict=True),
                # the update side's da as the tier takes it: rounded to bf16 in the kernel
                (sk.state_to_rows(x, col, stored, transposed=False, slot_offset=1,
                                  out_dtype=jnp.bfloat16, **tier),
                 sr.state_to_rows_reference(x, col, stored, transposed=False, slot_offset=1,
                                            upper=True)),
                # col formed in the kernels (the tier's calls, rows_to_state also with a
                # barrier per block)
                (tuple(u[:, :, 1:] for u in ss.rows_to_state(
                    xt, formed, a, kv_heads=hk, slots=n + 1, slot_offset=1, upper=True)),
                 sr.upper_arrays(s)),
                (ss.rows_to_state(xt, formed, a, kv_heads=hk, upper=True, step_barriers=3),
                 sr.upper_arrays(s)),
                *zip(sk.state_to_rows(x, formed, stored, transposed=False, slot_offset=1,
                                      normalizer=norm, **tier),
                     sr.state_to_rows_reference(x, col, stored, transposed=False, slot_offset=1,
                                                normalizer=norm, upper=True), strict=True),
                (sk.state_to_rows(x, formed, stored, transposed=False, slot_offset=1,
                                  out_dtype=jnp.bfloat16, **tier),
                 sr.state_to_rows_reference(x, col, stored, transposed=False, slot_offset=1,
                                            upper=True)),
                *zip(sk.row_gradients(a, x, formed, stored, slot_offset=1, normalizer=norm),
                     sr.row_gradients_reference(a, x, col, stored, slot_offset=1,
                                                normalizer=norm), strict=True)]

    rows = []
    names = ("S", "y", "g", "dx", "dls", "y_z", "den", "dx_z", "dls_z", "S_slots", "S_chunks",
             "S_one", "y_slots", "y_chunks", "dx_slots", "dx_chunks", "y_upper", "y_z_upper",
             "den_upper", "y_slots_upper", "y_packed", "y_z_packed", "den_packed",
             "y_slots_packed", "y_halves", "y_z_halves", "den_halves", "y_slots_halves",
             "y_square_halves", "dx_halves", "dls_halves", "S_whole_steps", "S_stored_upper",
             "S_stored_upper_whole_steps", "S_stored_upper_square_products", "y_stored_upper",
             "y_z_stored_upper", "den_stored_upper", "y_square_stored_upper",
             "g_stored_upper", "dx_z_stored_upper", "dls_z_stored_upper", "y_bf16_stored_upper",
             "S_formed", "S_formed_barriers", "y_z_formed", "den_formed", "y_bf16_formed",
             "dx_z_formed", "dls_z_formed")

    def flat(value):  # an output or a tuple of them (the upper layout) as one float64 vector
        return np.concatenate([np.ravel(np.asarray(v, np.float64))
                               for v in jax.tree.leaves(value)])

    w = jnp.exp(2.0 * jnp.asarray(ls, jnp.float32))  # col = x^T w, as `columns` forms it
    for name, (got, want) in zip(names, run(xt, col, a, x, s, z, weights, w), strict=True):
        # a bf16 row must leave the kernel in bf16
        dtype_ok = "bf16" not in name or got.dtype == jnp.bfloat16
        got, want = flat(got), flat(want)
        err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        zero = scales == "full" and not np.any(got)  # every row scaled to 0: exactly 0
        # den: float32-accurate products of the bf16 rows with Z's parts
        tol = 1e-5 if name.startswith("den") else 1e-2
        ok = (dtype_ok and bool(np.all(np.isfinite(got)))
              and (zero if scales == "full" else err <= tol))
        rows.append((name, err, "exact 0" if scales == "full" else f"tol {tol:g}", ok))
    rows.append(check_gram(x, weights, hk, scales))
    return rows


def check_gram(x, weights, kv_heads: int, scales: str):
    """The row (output, err, note, ok) of the normalizer sums (gram.weighted_gram) against
    float64: the largest error of an entry over its scale (the sum of the terms'
    magnitudes), at most 1e-6 or twice that of the XLA product it replaced (an einsum of
    BF16_BF16_F32_X6; the note also gives a float32 HIGHEST einsum's); every weight 0
    (scales "full") must give exactly 0."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.attention.mosaic_gpu import gram

    b, hx, n, _, d = x.shape

    def per_group(g):  # [B, Hx, N, d, d] summed over each kv group's heads
        return g.reshape(b, kv_heads, hx // kv_heads, n, d, d).sum(axis=2)

    def xla(precision):
        return per_group(jnp.einsum("bhnci,bhncj->bhnij",
                                    x.astype(jnp.float32) * weights[..., None],
                                    x.astype(jnp.float32), precision=precision))

    got, x6, f32 = jax.jit(lambda: (gram.weighted_gram(x, weights, kv_heads=kv_heads),
                                    xla(jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6),
                                    xla(jax.lax.Precision.HIGHEST)))()
    x64, w64 = np.asarray(x, np.float64), np.asarray(weights, np.float64)[..., None]
    want = per_group(np.einsum("bhnci,bhncj->bhnij", w64 * x64, x64))
    scale = np.maximum(per_group(np.einsum("bhnci,bhncj->bhnij", np.abs(w64 * x64),
                                           np.abs(x64))), 1e-300)
    err, err_x6, err_f32 = (float(np.max(np.abs(np.asarray(g, np.float64) - want) / scale))
                            for g in (got, x6, f32))
    if scales == "full":
        return "gram", err, "exact 0", not np.any(np.asarray(got))
    ok = bool(np.all(np.isfinite(np.asarray(got)))) and err <= max(1e-6, 2 * err_x6)
    return "gram", err, f"x6 {err_x6:.2e} f32 {err_f32:.2e}", ok
