"""Attention layers: sympow (with optional gating and rotary) and the softmax baseline.

Both share one head layout: queries in n_head heads, keys and values in n_kv_head heads
(grouped queries: query head n reads key/value head n // (n_head // n_kv_head)), head dim
D = E = d_model // n_head, projections `nn.Linear` WITH bias (GPT-2 style: c_attn and c_proj
have biases), q, k and v projected separately (the parameter count equals GPT-2's fused
c_attn when n_kv_head == n_head).

Gating ([conformal] §3.1): gamma_i = sigmoid(W_gamma x_i + b_gamma), one scalar per
key/value head, passed to the kernels as log_g = log_sigmoid(.) <= 0. The papers' gate has
no bias (gamma_i = sigmoid(W_gamma x_i)); b_gamma is our addition and configurable
(``gate_bias``: its initial value; None = no bias, the papers' form). Without it a fresh
gate is gamma ~ 0.5, a memory of ~2 tokens, hence the library's default of +5 (gamma ~
0.9933, a memory of ~150 tokens): a fresh model starts close to ungated sympow and learns
to forget. W_gamma starts like the other projections (normal, std 0.02).

Rotary ([conformal] §A.1.2 and §3.2): 'fixed' uses mu_i = i; 'learned' uses
mu_i = mu_{i-1} + beta_i, beta_i = 1 + tanh(W_beta x_i), one scalar per key/value head,
broadcast to that head's query group (a query and the keys it reads must share mu for the
score to depend on mu_i - mu_j only, so beta cannot be per query head). W_beta has no bias
and starts at zero: beta = 1, i.e. a fresh learned-rotary model is exactly fixed rotary.
W_gamma and W_beta compute in at least float32: their outputs are summed over the context.
Rotations go through `sympow.rotary`, which rotates in float32 (also in float64 compute).

Every layer has three entry points: `__call__(x)` (training / full forward), `prefill(x)`
(forward that also returns a cache) and `decode(x, cache, position)` (one token).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float

from sympow.attention import (
    DECODE_IMPLS,
    SympowState,
    check_settings,
    chosen_algorithm,
    decode_step,
    init_state,
    prefill,
    sympow_attention,
)
from sympow.layers import rotary_kernel
from sympow.layers.linear import check_input, check_valid, product, products_side_by_side
from sympow.numerics import compute_dtype, is_finite_number, is_int
from sympow.rotary import apply_rotary, fixed_rotary_angles, learned_rotary_angles, rotary_rates

__all__ = ["ROTARY_KINDS", "Rotary", "SympowAttention", "SoftmaxAttention", "SympowCache",
           "KVCache", "GATE_BIAS_INIT", "check_gate_bias", "check_layout", "check_sympow_settings"]

# A layer's impl (that of sympow_attention) -> decode_step's: kernels stay kernels.
DECODE_IMPL = {"pallas": "pallas", "xla": "reference", "reference": "reference"}

ROTARY_KINDS = ("none", "fixed", "learned")
ROTARY_IMPLS = (None, "xla", "pallas")
GATE_BIAS_INIT = 5.0  # initial b_gamma; None (no bias) is the papers' gate


def check_gate_bias(gate_bias) -> float | None:
    """``gate_bias`` as a float, or None; ValueError unless None or a finite real number."""
    if gate_bias is None:
        return None
    if not is_finite_number(gate_bias):
        raise ValueError("gate_bias must be None (no bias: the papers' gate "
                         "sigmoid(W_gamma x)) or a finite real number, got "
                         f"gate_bias={gate_bias!r}")
    return float(gate_bias)


def check_sympow_settings(*, decode_impl: str | None, **settings) -> None:
    """`sympow.check_settings` (p, chunk_size, impl, algorithm) and decode_impl."""
    check_settings(**settings)
    if decode_impl is not None and decode_impl not in DECODE_IMPLS:
        raise ValueError(f"decode_impl must be one of {DECODE_IMPLS} or None, got "
                         f"decode_impl={decode_impl!r}")


class SympowCache(NamedTuple):
    """Recurrent cache of one sympow layer: (S, Z) and, for learned rotary, mu.

    state: SympowState with s [B, Hk, F, E] and z [B, Hk, F] (float32, float64 in x64).
    mu: [B, Hk] float32 accumulated rotation multiplier after the last token (learned
      rotary), or None. Fixed rotary reads the model's position counter instead.
    """

    state: SympowState
    mu: Array | None


class KVCache(NamedTuple):
    """Preallocated key/value cache of one softmax layer (keys stored after rotary).

    k: [B, L, Hk, D], v: [B, L, Hk, E] in the compute dtype, L = max_length; rows at and
    after the model's position counter are unused. mu: as in SympowCache. start: [B] int32,
    each sequence's first row (its left padding before it, see `prefill`'s valid), or None
    (every row from 0).
    """

    k: Array
    v: Array
    mu: Array | None
    start: Array | None = None


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


def check_layout(d_model: int, n_head: int, n_kv_head: int, rotary: str) -> int:
    """Validate the head layout; return the head dim D."""
    for name, value in (("d_model", d_model), ("n_head", n_head), ("n_kv_head", n_kv_head)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    if n_head % n_kv_head:
        raise ValueError(f"n_head must be a multiple of n_kv_head, got n_head={n_head}, "
                         f"n_kv_head={n_kv_head}")
    if d_model % n_head:
        raise ValueError(f"d_model must be divisible by n_head, got d_model={d_model}, "
                         f"n_head={n_head}")
    if rotary not in ROTARY_KINDS:
        raise ValueError(f"rotary must be one of {ROTARY_KINDS}, got rotary={rotary!r}")
    head_dim = d_model // n_head
    if rotary != "none" and head_dim % 2:
        raise ValueError(f"rotary={rotary!r} needs an even head dim d_model // n_head, got "
                         f"d_model={d_model}, n_head={n_head} (head dim {head_dim})")
    return head_dim


class Rotary(nnx.Module):
    """Fixed or learned rotary on q [B, T, Hq, D] and k [B, T, Hk, D].

    Angles are mu_i * theta_j with theta from `sympow.rotary_rates(D, base)`. For 'learned'
    the module owns W_beta (`beta_proj`, d_model -> Hk, no bias, zero init).

    impl: how learned rotary rotates: 'xla' (`sympow.rotary.apply_rotary`), 'pallas' (the
    kernels of `rotary_kernel`, which make cos and sin from mu in registers; the Pallas
    interpreter off a GPU) or None: 'pallas' on a GPU for calls of at least
    `rotary_kernel.BLOCK_ROWS` tokens whose shapes it takes, else 'xla' (decoding's few
    tokens stay one fused XLA pass).
    """

    def __init__(self, d_model: int, n_kv_head: int, head_dim: int, kind: str, *,
                 base: float = 65536.0, dtype=jnp.float32, param_dtype=jnp.float32,
                 impl: str | None = None, rngs: nnx.Rngs):
        if kind not in ROTARY_KINDS:
            raise ValueError(f"rotary must be one of {ROTARY_KINDS}, got rotary={kind!r}")
        if impl not in ROTARY_IMPLS:
            raise ValueError(f"rotary impl must be one of {ROTARY_IMPLS}, got impl={impl!r}")
        if not is_finite_number(base) or base <= 1:
            raise ValueError(f"rotary_base must be a finite number > 1, got rotary_base={base!r}")
        self.kind, self.base, self.head_dim, self.impl = kind, float(base), head_dim, impl
        if kind == "learned":
            self.beta_proj = nnx.Linear(
                d_model, n_kv_head, use_bias=False, kernel_init=nnx.initializers.zeros_init(),
                dtype=compute_dtype(dtype), param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self,
        x: Float[Array, "B T C"],
        q: Float[Array, "B T Hq D"],
        k: Float[Array, "B T Hk D"],
        *,
        position: Array | int = 0,
        mu0: Float[Array, "B Hk"] | None = None,
    ) -> tuple[Array, Array, Array | None]:
        """Rotate q and k; returns (q', k', mu [B, Hk] after the last token or None).

        position: index of the first token (fixed rotary: mu_i = position + i).
        mu0: learned rotary's mu before the first token (None = start of the sequence).
        """
        beta_logits = self.beta_proj(x) if self.kind == "learned" else None
        return self.rotate(beta_logits, q, k, position=position, mu0=mu0)

    def rotate(
        self,
        beta_logits: Float[Array, "B T Hk"] | None,
        q: Float[Array, "B T Hq D"],
        k: Float[Array, "B T Hk D"],
        *,
        position: Array | int = 0,
        mu0: Float[Array, "B Hk"] | None = None,
        layout: str = "tokens",
        biases: tuple[Float[Array, "Hq D"], Float[Array, "Hk D"]] | None = None,
    ) -> tuple[Array, Array, Array | None]:
        """`__call__` after the projection W_beta x (beta_logits; learned rotary only, else
        None): what a caller that computed every projection in one product runs. layout:
        where the kernels (see `impl`) write q' and k' (`rotary_kernel.rotate`'s layout:
        'heads' where the chunked algorithm reads them); the same numbers either way.
        biases: the q and k projections' biases when q and k come without them: the kernels
        add them as they load the rows, XLA as `nnx.Linear` adds its bias (in q's dtype)."""
        theta = rotary_rates(self.head_dim, self.base)  # [D/2]
        if self.kind == "learned":
            beta = 1.0 + jnp.tanh(beta_logits)  # [B, T, Hk]
            _, mu = learned_rotary_angles(beta, theta, mu0)  # mu [B, T, Hk]; rotate turns it
            if self._kernel_rotates(q, k, mu):
                q, k = rotary_kernel.rotate_together((q, k), mu, base=self.base,
                                                     biases=biases, layout=layout)
                return q, k, mu[:, -1]
        if biases is not None:
            q, k = (x + bias.astype(x.dtype) for x, bias in zip((q, k), biases, strict=True))
        if self.kind == "none":
            return q, k, None
        if self.kind == "fixed":
            positions = position + jnp.arange(q.shape[1])
            angles = fixed_rotary_angles(positions, theta)[None, :, None]  # [1, T, 1, D/2]
            return apply_rotary(q, angles), apply_rotary(k, angles), None
        # the specification: apply_rotary by mu theta, per kv head's query group
        rotate = functools.partial(rotary_kernel.rotate_reference, base=self.base)
        return rotate(q, mu), rotate(k, mu), mu[:, -1]

    def _kernel_rotates(self, q, k, mu) -> bool:
        """Whether `rotate` runs `rotary_kernel` (see `impl`)."""
        if self.impl == "xla":
            return False
        reason = rotary_kernel.unsupported(q, mu) or rotary_kernel.unsupported(k, mu)
        if self.impl == "pallas":
            if reason is not None:
                raise ValueError(f"rotary impl='pallas': {reason}")
            return True
        return (reason is None and jax.default_backend() == "gpu"
                and q.shape[0] * q.shape[1] >= rotary_kernel.BLOCK_ROWS)


class _Attention(nnx.Module):
    """Projections, optional gate and rotary shared by both attention layers.

    Args:
      d_model: model width C. n_head: query heads Hq. n_kv_head: key/value heads Hk (None:
        n_head); Hq must be a multiple of Hk and C divisible by Hq.
      gating: data-dependent gate gamma (W_gamma: ``gate_proj``). gate_bias: initial value
        of its bias b_gamma; None = no bias (the papers' gamma = sigmoid(W_gamma x)).
      rotary: 'none' | 'fixed' | 'learned'; rotary_base: N of theta_j = 2 pi / N^(2j/D).
      dtype: compute dtype; param_dtype: parameter dtype.
      init_std: std of the projections; out_init_std: std of the output projection (GPT-2
        scales it by 1/sqrt(2 n_layer)); None = init_std.
    """

    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None = None, *,
                 gating: bool = False, gate_bias: float | None = GATE_BIAS_INIT,
                 rotary: str = "none", rotary_base: float = 65536.0,
                 dtype=jnp.float32, param_dtype=jnp.float32, init_std: float = 0.02,
                 out_init_std: float | None = None, rngs: nnx.Rngs):
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        head_dim = check_layout(d_model, n_head, n_kv_head, rotary)
        self.d_model, self.n_head, self.n_kv_head = d_model, n_head, n_kv_head
        if not isinstance(gating, bool):  # bool('no') would be True
            raise ValueError(f"gating must be a bool (True or False), got gating={gating!r}")
        self.gating, self.dtype, self.head_dim = gating, jnp.dtype(dtype), head_dim
        gate_bias = check_gate_bias(gate_bias)
        out_std = init_std if out_init_std is None else out_init_std

        def linear(n_in, n_out, std):
            return nnx.Linear(n_in, n_out, kernel_init=_normal(std), dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(d_model, n_head * head_dim, init_std)
        self.k_proj = linear(d_model, n_kv_head * head_dim, init_std)
        self.v_proj = linear(d_model, n_kv_head * head_dim, init_std)
        self.out_proj = linear(n_head * head_dim, d_model, out_std)
        if self.gating:
            bias = {} if gate_bias is None else dict(
                bias_init=nnx.initializers.constant(gate_bias))
            self.gate_proj = nnx.Linear(
                d_model, n_kv_head, use_bias=gate_bias is not None,
                kernel_init=_normal(init_std), dtype=compute_dtype(dtype),
                param_dtype=param_dtype, rngs=rngs, **bias)
        self.rotary = Rotary(d_model, n_kv_head, head_dim, rotary, base=rotary_base,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def project(self, x: Float[Array, "B T C"], *, position=0, mu0=None,
                rotary_layout: str = "tokens"):
        """Returns (q [B,T,Hq,D], k [B,T,Hk,D], v [B,T,Hk,E], log_g [B,T,Hk] | None, mu);
        rotary_layout: `Rotary.rotate`'s layout. Under learned rotary the q and k products
        leave without their biases, which `Rotary.rotate` adds (inside its kernels where
        they run: XLA cannot fuse the add into a kernel, so it made a pass of its own)."""
        linears = self.projections()
        # the gate's and the rotary's products in one (float32, [C, 2 Hk] side by side)
        gate_and_beta = products_side_by_side(linears[3:], x) if linears[3:] else []
        if self.rotary.kind != "learned":
            return self.heads([linear(x) for linear in linears[:3]] + gate_and_beta,
                              position=position, mu0=mu0, rotary_layout=rotary_layout)
        outputs = [product(linear, x) for linear in linears[:2]]
        outputs += [linears[2](x)] + gate_and_beta
        biases = tuple(linear.bias[...].reshape(-1, self.head_dim) for linear in linears[:2])
        return self.heads(outputs, position=position, mu0=mu0, rotary_layout=rotary_layout,
                          biases=biases)

    def projections(self) -> list[nnx.Linear]:
        """The linear maps of x in the order `heads` takes their outputs: q, k, v, then the
        gate's W_gamma (gating) and the rotary's W_beta (learned rotary)."""
        linears = [self.q_proj, self.k_proj, self.v_proj]
        linears += [self.gate_proj] if self.gating else []
        return linears + ([self.rotary.beta_proj] if self.rotary.kind == "learned" else [])

    def heads(self, outputs: list[Array], *, position=0, mu0=None,
              rotary_layout: str = "tokens", biases=None):
        """`project` from the outputs [B, T, n_i] of `projections()`: heads split, rotary,
        the gate's log; the same returns. biases: `Rotary.rotate`'s (q and k's outputs
        without their projections' biases), or None (every output complete)."""
        q, k, v, *rest = outputs
        b, t, _ = q.shape
        q = q.reshape(b, t, self.n_head, self.head_dim)  # [B, T, Hq, D]
        k = k.reshape(b, t, self.n_kv_head, self.head_dim)  # [B, T, Hk, D]
        v = v.reshape(b, t, self.n_kv_head, self.head_dim)  # [B, T, Hk, E]
        gate = rest.pop(0) if self.gating else None
        beta_logits = rest.pop(0) if self.rotary.kind == "learned" else None
        q, k, mu = self.rotary.rotate(beta_logits, q, k, position=position, mu0=mu0,
                                      layout=rotary_layout, biases=biases)
        log_g = None if gate is None else jax.nn.log_sigmoid(gate)  # [B, T, Hk]
        return q, k, v, log_g, mu

    def decode(self, x: Float[Array, "B 1 C"], cache, position: Array):
        """One token at index `position`: (output [B, 1, C], the cache after it)."""
        check_input(x, self.d_model, one_token=True)
        q, k, v, log_g, mu = self.project(x, position=position, mu0=cache.mu)
        y, cache = self.decode_heads(q, k, v, log_g, mu, cache, position)
        return self.merge_heads(y), cache

    def merge_heads(self, y: Float[Array, "B T Hq E"]) -> Float[Array, "B T C"]:
        return self.out_proj(y.reshape(*y.shape[:2], -1))


class SympowAttention(_Attention):
    """Causal symmetric power attention ([conformal]): sympow, +gating, conformal-sympow.

    Extra args over the shared ones (see `_Attention`: gating, gate_bias, rotary, ...): p
    (even power), chunk_size, impl and algorithm (passed to `sympow.sympow_attention` and
    `sympow.prefill`; None = choose). decode_impl: `sympow.decode_step`'s impl ('pallas' the
    fused step kernel, 'reference' the jnp step); None follows impl (a kernel impl decodes
    with the kernel, 'xla' and 'reference' with the jnp step; impl None: decode_step's
    default, the kernel on a GPU).
    conformal-sympow = gating=True, rotary='learned'. No 1/sqrt(D) scale: a global scale of
    q or k cancels in the normalized attention.
    """

    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None = None, *, p: int = 2,
                 chunk_size: int | None = None, impl: str | None = None,
                 algorithm: str | None = None, decode_impl: str | None = None,
                 rngs: nnx.Rngs, **kwargs):
        check_sympow_settings(p=p, chunk_size=chunk_size, impl=impl, algorithm=algorithm,
                              decode_impl=decode_impl)
        super().__init__(d_model, n_head, n_kv_head, rngs=rngs, **kwargs)
        self.p, self.chunk_size, self.impl, self.algorithm = p, chunk_size, impl, algorithm
        if decode_impl is None and impl is not None:
            decode_impl = DECODE_IMPL[impl]
        self.decode_impl = decode_impl

    def __call__(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        check_input(x, self.d_model)
        q, k, v, log_g, _ = self.project(x, rotary_layout=self._rotary_layout(x.shape[1]))
        y = sympow_attention(q, k, v, log_g, p=self.p, chunk_size=self.chunk_size,
                             impl=self.impl, algorithm=self.algorithm)  # [B, T, Hq, E]
        return self.merge_heads(y)

    def prefill(self, x: Float[Array, "B T C"], *, max_length: int | None = None,
                valid: Bool[Array, "B T"] | None = None
                ) -> tuple[Float[Array, "B T C"], SympowCache]:
        """Forward over a prompt and the recurrent cache after it (max_length unused); the
        attention form's state is streamed (`sympow.prefill`).

        valid: False for left padding (a batch of prompts of several lengths, aligned at
        their ends). Padding keys are zeroed: phi(0) = 0, so they enter no score and no
        state; scores depend only on mu_i - mu_j, so the shift of the real tokens'
        positions changes nothing.
        """
        del max_length
        check_input(x, self.d_model)
        check_valid(valid, x)
        q, k, v, log_g, mu = self.project(
            x, rotary_layout=self._rotary_layout(x.shape[1], need_state=True))
        if valid is not None:
            k = jnp.where(valid[:, :, None, None], k, jnp.zeros((), k.dtype))
        y, state = prefill(q, k, v, log_g, p=self.p, chunk_size=self.chunk_size,
                           impl=self.impl, algorithm=self.algorithm)
        return self.merge_heads(y), SympowCache(state, mu)

    def _rotary_layout(self, length: int, *, need_state: bool = False) -> str:
        """'heads' where the attention will run the chunked algorithm (it reads q and k in
        chunk layout, [B, H, T, D] reshaped), else 'tokens'."""
        algorithm = chosen_algorithm(length, self.head_dim, self.head_dim, self.p,
                                     chunk_size=self.chunk_size, impl=self.impl,
                                     algorithm=self.algorithm, need_state=need_state)
        return "heads" if algorithm == "chunked" else "tokens"

    def decode_heads(self, q: Float[Array, "B 1 Hq D"], k: Float[Array, "B 1 Hk D"],
                     v: Float[Array, "B 1 Hk E"], log_g: Float[Array, "B 1 Hk"] | None, mu,
                     cache: SympowCache, position: Array
                     ) -> tuple[Float[Array, "B 1 Hq E"], SympowCache]:
        """`decode` after the projections: O(F E) per head whatever the context length."""
        del position
        state, y = decode_step(cache.state, q[:, 0], k[:, 0], v[:, 0],
                               None if log_g is None else log_g[:, 0], p=self.p,
                               impl=self.decode_impl)
        return y[:, None], SympowCache(state, mu)

    def init_cache(self, batch: int, max_length: int | None = None) -> SympowCache:
        """An empty cache (no context); the state is float32 (float64 for float64 compute)."""
        del max_length
        dtype = compute_dtype(self.dtype)
        state = init_state(batch, self.n_kv_head, self.head_dim, self.head_dim, self.p, dtype=dtype)
        mu = jnp.zeros((batch, self.n_kv_head), jnp.float32)
        return SympowCache(state, mu if self.rotary.kind == "learned" else None)


class SoftmaxAttention(_Attention):
    """Causal softmax attention baseline (default fixed RoPE), scale 1/sqrt(D).

    Uses `jax.nn.dot_product_attention(..., is_causal=True)` with implementation='cudnn'
    on GPU for bf16/fp16 compute and 'xla' otherwise. Decoding reads a preallocated KV
    cache (`prefill(x, max_length=L)`), in float32 softmax.
    """

    def __init__(self, d_model: int, n_head: int, n_kv_head: int | None = None, *,
                 rotary: str = "fixed", gating: bool = False, rngs: nnx.Rngs, **kwargs):
        if gating is not False:  # the gate is sympow's
            raise ValueError(f"the softmax baseline takes gating=False, got gating={gating!r}")
        super().__init__(d_model, n_head, n_kv_head, rotary=rotary, rngs=rngs, **kwargs)

    def _implementation(self) -> str:
        low_precision = self.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if jax.default_backend() == "gpu" and low_precision else "xla"

    def __call__(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        check_input(x, self.d_model)
        q, k, v, _, _ = self.project(x)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self._implementation())  # [B,T,Hq,E]
        return self.merge_heads(y)

    def prefill(self, x: Float[Array, "B T C"], *, max_length: int,
                valid: Bool[Array, "B T"] | None = None
                ) -> tuple[Float[Array, "B T C"], KVCache]:
        """Full forward over the prompt; keys/values written to a cache of max_length rows.

        valid: False for left padding (prompts aligned at their ends). Real queries see no
        padding key; a padding query sees only itself (finite, and discarded), through an
        explicit mask and the 'xla' implementation; the cache records each row's start.
        """
        check_input(x, self.d_model)
        b, t, _ = x.shape
        if not is_int(max_length) or max_length < t:
            raise ValueError(f"max_length must be an int >= the prompt length {t}, got "
                             f"max_length={max_length!r}")
        check_valid(valid, x)
        q, k, v, _, mu = self.project(x)
        if valid is None:
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation=self._implementation())
            start = None
        else:
            rows = jnp.arange(t)
            causal = rows[:, None] >= rows[None, :]  # [T, T]
            mask = causal & (valid[:, None, :] | (rows[:, None] == rows[None, :]))  # [B,T,T]
            y = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                             implementation="xla")
            start = (t - jnp.sum(valid, axis=1)).astype(jnp.int32)  # [B] padding rows
        cache = self.init_cache(b, max_length)
        k_cache = jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, 0))  # [B, L, Hk, D]
        v_cache = jax.lax.dynamic_update_slice(cache.v, v, (0, 0, 0, 0))  # [B, L, Hk, E]
        return self.merge_heads(y), KVCache(k_cache, v_cache, mu, start)

    def decode_heads(self, q: Float[Array, "B 1 Hq D"], k: Float[Array, "B 1 Hk D"],
                     v: Float[Array, "B 1 Hk E"], log_g: None, mu, cache: KVCache,
                     position: Array) -> tuple[Float[Array, "B 1 Hq E"], KVCache]:
        """`decode` after the projections; position < max_length (not checked: traced)."""
        del log_g
        index = (0, position, 0, 0)
        k_cache = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), index)
        v_cache = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), index)
        b, _, hq, d = q.shape
        hk, length = self.n_kv_head, k_cache.shape[1]
        ct = compute_dtype(self.dtype)
        qg = q.reshape(b, hk, hq // hk, d).astype(ct)  # [B, Hk, R, D]
        scores = jnp.einsum("bhrd,blhd->bhrl", qg, k_cache.astype(ct),
                            precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
        rows = jnp.arange(length)
        visible = rows <= position  # [L]
        if cache.start is not None:  # [B, L]: not the left padding
            visible = visible & (rows[None, :] >= cache.start[:, None])
            visible = visible[:, None, None, :]  # [B, 1, 1, L]
        weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        y = jnp.einsum("bhrl,blhe->bhre", weights, v_cache.astype(ct),
                       precision=jax.lax.Precision.HIGHEST)  # [B, Hk, R, E]
        y = y.reshape(b, 1, hq, -1).astype(self.dtype)
        return y, KVCache(k_cache, v_cache, mu, cache.start)

    def init_cache(self, batch: int, max_length: int) -> KVCache:
        shape = (batch, max_length, self.n_kv_head, self.head_dim)
        mu = jnp.zeros((batch, self.n_kv_head), jnp.float32)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype),
                       mu if self.rotary.kind == "learned" else None)
