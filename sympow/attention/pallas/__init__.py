"""The portable kernel tier: Pallas `pallas_call` kernels of the chunked algorithm's primitives.

Lowered through Triton on GPU and run by the Pallas interpreter elsewhere (CPU CI). Modules
by role: `plan` (support and block sizes), `launch` (the launcher and index helpers), `phi`
(phi tiles on chip), `attention_kernels`, `state_kernels`, `prefix_kernels` (kernel families),
`vjps` (one custom_vjp per primitive), `primitives` (padding and fallback: the tier's
`ChunkPrimitives`). Nothing is registered on import: the implementation table in
`sympow.attention.implementations` names this tier explicitly. Design and measurements:
docs/design.md §5.2 and docs/kernels.md.
"""
