"""A tour of the functional API on random data (CPU or GPU).

Run: python examples/api_tour.py
"""

import jax
import jax.numpy as jnp

import sympow


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 5)
    b, t, hq, hk, d = 2, 300, 4, 2, 16
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k = jax.random.normal(keys[1], (b, t, hk, d))
    v = jax.random.normal(keys[2], (b, t, hk, d))
    log_g = jax.nn.log_sigmoid(4.0 + jax.random.normal(keys[3], (b, t, hk)))

    theta = sympow.rotary_rates(d)
    beta = 1 + jnp.tanh(jax.random.normal(keys[4], (b, t, hk)))
    angles, _ = sympow.learned_rotary_angles(beta, theta)
    q = sympow.apply_rotary(q, jnp.repeat(angles, hq // hk, axis=2))
    k = sympow.apply_rotary(k, angles)

    print(f"backend {jax.default_backend()}, implementations {sympow.available_impls()}")
    y = sympow.sympow_attention(q, k, v, log_g, p=2)
    y_ref = sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference")
    print(f"chunked vs attention form, max |diff| = {float(jnp.abs(y - y_ref).max()):.2e}")

    y_prompt, state = sympow.prefill(q[:, :-1], k[:, :-1], v[:, :-1], log_g[:, :-1], p=2)
    state, y_last = sympow.decode_step(state, q[:, -1], k[:, -1], v[:, -1], log_g[:, -1], p=2)
    print(f"prefill + one decode step vs full, max |diff| = "
          f"{float(jnp.abs(y_last - y[:, -1]).max()):.2e}; state s {state.s.shape}")
    for p in (2, 4, 6):
        print(f"GPT-2 small state, p={p}: {sympow.state_bytes(64, p, layers=12, heads=12):.3e} B")


if __name__ == "__main__":
    main()
