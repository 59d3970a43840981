"""What the dQ partials' TMA reductions cost the one-pass attention backward on Hopper
(docs/kernels.md, "The attention form's backward with the normalized weights recomputed,
tried and not merged; the dQ partials' reductions measured"): the bound on what a design
that halves them could gain (on an H100, 2026-12-08: none).

The backward kernel (`sympow.attention.mosaic_gpu.backward_kernel`) adds every off-diagonal
tile pair's float32 dQ partial [64 queries, d] into dQ in GMEM by a TMA reduction: at GPT-2
small's 4k shapes (B = 16, T = 4,096, H = 12, d = 64, token layout) 6.34 GB a call,
against a measured ~2.7 TB/s for such reductions (probe_tma_reduce.py). This times the
kernel as it is against the same kernel with those reductions turned into plain stores
(same bytes, no read-modify-write) and left out (no dQ traffic at all; dq then wrong):
the time the reductions cost is the bound on what summing the two warpgroups' partials
before one reduction (half the traffic) could gain. The kernel's GPU time comes from
jax's profiler (the kernel named sympow_attention_bwd), the variants timed in turns.

  PYTHONPATH=. python3 experiments/probe_dq_traffic.py --out=$OUT

Prints one JSON row per variant and writes probe_dq_traffic.json under --out. Needs a
Hopper GPU (Mosaic GPU kernels); on anything else it exits with the reason.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from probes import attempt, hopper_main  # noqa: E402  (beside this script)

_SHAPE = flags.DEFINE_list("shape", ["16", "4096", "12"], "B, T, H (GPT-2 small at 4k)")
_REPS = flags.DEFINE_integer("reps", 10, "profiled calls per variant and round")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "rounds of the variants in turns")
_OUT = flags.DEFINE_string("out", None, "directory for probe_dq_traffic.json")

VARIANTS = ("reduce", "store", "none")  # what becomes of the dQ partials' TMA reductions
KERNEL = "sympow_attention_bwd"


class _DqCopies:
    """`plgpu` for backward_kernel's trace, its reductions ('add' copies: in token layout the
    dQ partials only) kept, made plain stores ('store') or left out ('none')."""

    def __init__(self, plgpu, variant: str):
        self._plgpu, self._variant = plgpu, variant

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    def copy_smem_to_gmem(self, src, dst, *args, reduction_op=None, **kwargs):
        if reduction_op == "add" and self._variant != "reduce":
            if self._variant == "none":
                return None
            reduction_op = None
        return self._plgpu.copy_smem_to_gmem(src, dst, *args, reduction_op=reduction_op,
                                             **kwargs)


def backward_inputs(b: int, t: int, h: int, d: int = 64):
    """The Hopper backward's arguments (q, k, v, a, head, tail, m, c, dy, dden) on the
    attention form's token-layout inputs of that shape (bf16, p = 2), its residuals from the
    forward kernel (which needs the GPU)."""
    import jax.numpy as jnp
    from timing import attention_inputs

    from sympow.attention.chunked import to_chunks
    from sympow.attention.mosaic_gpu import attention_kernels
    from sympow.attention.pallas import attention_kernels as portable_kernels
    from sympow.attention.pallas.plan import make_form_plan

    q, k, v, log_g, dy = attention_inputs(t, h, tokens=b * t, d=d)
    plan = make_form_plan(2, d, d, t, "bfloat16", False)
    a = to_chunks(log_g, 1, t)  # [B, H, 1, T]
    head, tail = portable_kernels.block_gate_sums(a, plan)
    _, den, m, c = attention_kernels.attention_fwd(q, k, v, a, head, tail, p=2,
                                                   normalized=True)
    return q, k, v, a, head, tail, m, c, dy, jnp.zeros_like(den)


def lowered_backward(variant: str, args, **lower):
    """`backward_kernel.attention_bwd` (p = 2) jitted and lowered for `args` (arrays or
    ShapeDtypeStructs in `backward_inputs`' order; `lower`: jax's lower() options), its
    dQ reductions as `variant` says: traced with a patched `plgpu`, restored after."""
    import jax

    from sympow.attention.mosaic_gpu import backward_kernel

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")

    def backward(q, k, v, a, head, tail, m, c, dy, dden):
        return backward_kernel.attention_bwd(q, k, v, a, head, tail, m, c, dy, dden, p=2)

    plgpu = backward_kernel.plgpu
    backward_kernel.plgpu = _DqCopies(plgpu, variant)
    try:
        return jax.jit(backward).trace(*args).lower(**lower)
    finally:
        backward_kernel.plgpu = plgpu


def probe_variants() -> list[dict]:
    from timing import trace_kernels

    b, t, h = map(int, _SHAPE.value)
    args = backward_inputs(b, t, h)
    calls = {variant: lowered_backward(variant, args).compile() for variant in VARIANTS}
    times = {variant: [] for variant in VARIANTS}
    for _ in range(_ROUNDS.value):
        for variant, fn in calls.items():
            events, _ = trace_kernels(fn, *args, reps=_REPS.value)
            kernel = [duration for name, _, duration in events if KERNEL in name]
            if not kernel:
                names = sorted({name for name, *_ in events})
                raise ValueError(f"no kernel named {KERNEL} among {names}")
            every = sum(duration for _, _, duration in events)
            times[variant].append((sum(kernel) / len(kernel) / 1e3, every / _REPS.value / 1e3))
    pairs = b * h * (t // 64) * (t // 64 - 1) // 2  # off-diagonal [64, 64] tile pairs
    rows = []
    for variant in VARIANTS:
        def measure(variant=variant):
            kernel_us = [kernel for kernel, _ in times[variant]]
            return dict(kernel_us=kernel_us, call_us=[call for _, call in times[variant]],
                        dq_reduced_gb=pairs * 64 * 64 * 4 / 1e9 if variant == "reduce" else 0)
        rows.append(attempt(dict(probe="dq_traffic", variant=variant, b=b, t=t, h=h), measure))
    return rows


def main(argv):
    del argv
    hopper_main("probe_dq_traffic", _OUT.value, probe_variants)


if __name__ == "__main__":
    app.run(main)
