"""GPT-2 style language model with softmax, sympow or conformal-sympow attention.

The architecture of [conformal] §4 (docs/references.md): GPT-2 (pre-LN blocks, 4x GELU MLP,
biases, output head tied to the token embedding) with rotary instead of a position embedding
table and an extra LayerNorm after the token embedding.

    model = GPT(GPTConfig.preset("conformal", size="small", p=4), rngs=nnx.Rngs(0))
    logits = model(tokens)                       # ids [B, T] in [0, V) -> float32 [B, T, V]
    logits, cache = model.prefill(tokens)        # forward + recurrent state
    logits, cache = model.decode_step(tok, cache)  # one token, O(1) in the context length
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from sympow import embedding
from sympow.layers import decode
from sympow.layers.attention import (
    GATE_BIAS_INIT,
    SoftmaxAttention,
    SympowAttention,
    check_gate_bias,
    check_layout,
    check_sympow_settings,
)
from sympow.layers.linear import bias_gelu, product
from sympow.numerics import compute_dtype, is_finite_number, is_int

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "SIZES", "ModelReport", "model_report",
           "preset_name", "tied_logits"]

ATTENTION_KINDS = ("softmax", "sympow")

# The four variants of [conformal] and [conformal-article] (docs/references.md): the one table
# of them (configs name these presets). All use rotary (fixed unless learned), as in the papers.
PRESETS: dict[str, dict[str, Any]] = {
    "softmax": dict(attention="softmax", gating=False, rotary="fixed"),
    "sympow": dict(attention="sympow", gating=False, rotary="fixed"),
    "sympow_gating": dict(attention="sympow", gating=True, rotary="fixed"),
    "conformal": dict(attention="sympow", gating=True, rotary="learned"),
}
# Other spellings users type (experiment config args say "gating"), to the preset names.
_ALIASES = {"gating": "sympow_gating", "sympow+gating": "sympow_gating",
            "conformal-sympow": "conformal", "conformal_sympow": "conformal"}

# Model sizes; 'small' is GPT-2 small (124M with vocab 50304, the padded GPT-2 vocabulary).
# 'micro' is the CPU smoke-test model of the experiment configs' ``runlocal``.
SIZES: dict[str, dict[str, int]] = {
    "micro": dict(n_layer=2, n_head=2, d_model=64),
    "tiny": dict(n_layer=2, n_head=4, d_model=128),
    "small": dict(n_layer=12, n_head=12, d_model=768),
    "medium": dict(n_layer=24, n_head=16, d_model=1024),
}


def preset_name(variant: str) -> str:
    """The ``PRESETS`` key of a variant name or alias (e.g. 'gating' -> 'sympow_gating')."""
    name = _ALIASES.get(variant, variant)
    if name not in PRESETS:
        raise ValueError(f"variant must be one of {tuple(PRESETS)}, got {variant!r}")
    return name


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Static model settings (hashable).

    vocab_size: token vocabulary V. n_layer, n_head, d_model: GPT-2 sizes.
    n_kv_head: key/value heads (grouped queries); None = n_head.
    attention: 'softmax' | 'sympow'. p: even power (sympow). gating: data-dependent gate.
    gate_bias: initial value of the gate's bias b_gamma (default +5: gamma ~ 0.9933 at init,
      close to ungated); None = no bias, the papers' form gamma = sigmoid(W_gamma x), which
      starts at gamma ~ 0.5. Unused without gating.
    rotary: 'none' | 'fixed' | 'learned'; rotary_base: N in theta_j = 2 pi / N^(2j/D).
    chunk_size, impl, algorithm: passed to `sympow.sympow_attention` (None = choose).
    decode_impl: `sympow.decode_step`'s impl (None follows impl; see `SympowAttention`).
      The sympow fields (p, chunk_size, impl, algorithm, decode_impl) are checked whatever
      the attention: a wrong value is an error, never silently ignored.
    dtype: compute dtype; param_dtype: parameter dtype (e.g. 'bfloat16' and 'float32').
    max_length: KV-cache rows of the softmax baseline when prefill gets no max_length.
    mlp_ratio: MLP hidden width / d_model. layer_norm_eps: LayerNorm epsilon (GPT-2: 1e-5).
    init_std: std of weights (GPT-2: 0.02; residual projections get init_std/sqrt(2 n_layer)).
    """

    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    n_kv_head: int | None = None
    attention: str = "sympow"
    p: int = 2
    gating: bool = False
    gate_bias: float | None = GATE_BIAS_INIT
    rotary: str = "fixed"
    rotary_base: float = 65536.0
    chunk_size: int | None = None
    impl: str | None = None
    algorithm: str | None = None
    decode_impl: str | None = None
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    max_length: int = 1024
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got "
                             f"attention={self.attention!r}")
        for name in ("vocab_size", "n_layer", "max_length", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        for name in ("layer_norm_eps", "init_std"):  # nan or <= 0: NaN or all-zero weights
            value = getattr(self, name)
            if not is_finite_number(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")
        check_layout(self.d_model, self.n_head, self.kv_heads, self.rotary)
        check_sympow_settings(p=self.p, chunk_size=self.chunk_size, impl=self.impl,
                              algorithm=self.algorithm, decode_impl=self.decode_impl)
        object.__setattr__(self, "gate_bias", check_gate_bias(self.gate_bias))

    @classmethod
    def preset(cls, variant: str, size: str = "small", **overrides) -> GPTConfig:
        """A named variant ('softmax' | 'sympow' | 'sympow_gating' | 'conformal', or an alias
        of `preset_name`) at a size ('micro' | 'tiny' | 'small' | 'medium'), with any field
        overridden."""
        variant = preset_name(variant)
        if size not in SIZES:
            raise ValueError(f"size must be one of {tuple(SIZES)}, got size={size!r}")
        return cls(**{**SIZES[size], **PRESETS[variant], **overrides})

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def _attention(config: GPTConfig, rngs: nnx.Rngs):
    common = dict(gating=config.gating, rotary=config.rotary, rotary_base=config.rotary_base,
                  dtype=config.dtype, param_dtype=config.param_dtype, init_std=config.init_std,
                  out_init_std=config.init_std / (2 * config.n_layer) ** 0.5, rngs=rngs)
    if config.attention == "softmax":
        return SoftmaxAttention(config.d_model, config.n_head, config.n_kv_head, **common)
    return SympowAttention(config.d_model, config.n_head, config.n_kv_head, p=config.p,
                           chunk_size=config.chunk_size, impl=config.impl,
                           algorithm=config.algorithm, decode_impl=config.decode_impl,
                           gate_bias=config.gate_bias, **common)


def _layer_norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.d_model, epsilon=config.layer_norm_eps, dtype=config.dtype,
                         param_dtype=config.param_dtype, rngs=rngs)


class Block(nnx.Module):
    """Pre-LN GPT-2 block: x + attn(ln1(x)), then x + mlp(ln2(x)); MLP C -> 4C -> C, GELU."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        hidden = config.mlp_ratio * config.d_model
        out_std = config.init_std / (2 * config.n_layer) ** 0.5
        self.ln1 = _layer_norm(config, rngs)
        self.attn = _attention(config, rngs)
        self.ln2 = _layer_norm(config, rngs)
        self.fc = nnx.Linear(config.d_model, hidden, kernel_init=nnx.initializers.normal(
            config.init_std), dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
        self.proj = nnx.Linear(hidden, config.d_model, kernel_init=nnx.initializers.normal(
            out_std), dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)

    def mlp(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        # GPT-2's tanh-approximate GELU, recomputed from the product in the backward
        return self.proj(bias_gelu(product(self.fc, x), self.fc.bias[...]))

    def __call__(self, x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def prefill(self, x: Float[Array, "B T C"], *, max_length: int, valid=None):
        y, cache = self.attn.prefill(self.ln1(x), max_length=max_length, valid=valid)
        x = x + y
        return x + self.mlp(self.ln2(x)), cache

    def decode(self, x: Float[Array, "B 1 C"], cache, position: Array):
        y, cache = self.attn.decode(self.ln1(x), cache, position)
        x = x + y
        return x + self.mlp(self.ln2(x)), cache


@jax.custom_vjp
def tied_logits(x: Float[Array, "B T C"], table: Float[Array, "V C"]) -> Float[Array, "B T V"]:
    """Logits x table^T accumulated and returned in >= float32 (`compute_dtype`).

    The backward rounds the logits' cotangent to x's dtype before its two products (dx and
    dtable, accumulated in >= float32), as bf16 mixed precision does at the head: autodiff
    would run both in float32 on a float32 cotangent [B, T, V] (for GPT-2 small at 65,536
    tokens a step, two TF32 GEMMs of 32 ms on an H200; two bf16 ones of 12 ms on an H100;
    docs/kernels.md). For float32 or float64 x it is autodiff's backward.
    """
    return _tied_logits_fwd(x, table)[0]


def _tied_logits_fwd(x, table):
    logits = jnp.einsum("btc,vc->btv", x, table, preferred_element_type=compute_dtype(x))
    return logits, (x, table)


def _tied_logits_bwd(res, dlogits):
    x, table = res
    acc = compute_dtype(x)
    dlogits = dlogits.astype(x.dtype)  # [B, T, V]
    dx = jnp.einsum("btv,vc->btc", dlogits, table, preferred_element_type=acc)
    dtable = jnp.einsum("btv,btc->vc", dlogits, x, preferred_element_type=acc)
    return dx.astype(x.dtype), dtable.astype(table.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


class GPT(nnx.Module):
    """GPT-2 language model; see the module docstring.

    Token embedding (normal 0.02) -> LayerNorm -> n_layer blocks -> LayerNorm -> logits
    against the same embedding matrix (tied head). No position table: position enters
    through rotary. The residual stream is in the compute dtype; logits are float32
    (float64 when the compute dtype is float64).
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.wte = nnx.Embed(config.vocab_size, config.d_model,
                             embedding_init=nnx.initializers.normal(config.init_std),
                             dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
        self.ln_emb = _layer_norm(config, rngs)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = _layer_norm(config, rngs)

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T C"]:
        return self.ln_emb(self.wte(tokens))

    def head(self, x: Float[Array, "B T C"]) -> Float[Array, "B T V"]:
        """Final LayerNorm and the tied output projection (`tied_logits`)."""
        x = self.ln_f(x)
        return tied_logits(x, self.wte.embedding[...].astype(x.dtype))

    def __call__(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T V"]:
        """Logits of every position; token ids must lie in [0, vocab_size) (not checked: they
        may be traced; an id outside gives NaN logits)."""
        decode.check_tokens(tokens)
        x = self.embed(tokens)  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def prefill(self, tokens: Int[Array, "B T"], *, max_length: int | None = None,
                valid=None, last_only: bool = False):
        """(logits [B, T, V] or, last_only, [B, V], cache) after the prompt; see
        `sympow.layers.decode.prefill`."""
        return decode.prefill(self, tokens, max_length=max_length, valid=valid,
                              last_only=last_only)

    def decode_step(self, token: Int[Array, " B"], cache: decode.GPTCache):
        """(logits [B, V], cache) for one more token; see `sympow.layers.decode.decode_step`."""
        return decode.decode_step(self, token, cache)

    def init_cache(self, batch: int, max_length: int | None = None) -> decode.GPTCache:
        """An empty cache (no context yet) to decode from the first token."""
        max_length = self.config.max_length if max_length is None else max_length
        layers = tuple(b.attn.init_cache(batch, max_length) for b in self.blocks)
        return decode.GPTCache(layers, jnp.zeros((), jnp.int32))

    def state_bytes(self, **kwargs) -> int:
        """Inference state size; same arguments as `state_bytes(config, ...)`."""
        return state_bytes(self.config, **kwargs)

    def report(self) -> ModelReport:
        return model_report(self.config)


def state_bytes(config: GPTConfig, *, batch: int = 1, context: int | None = None,
                bytes_per_number: int | None = None) -> int:
    """Bytes of the decoding state of `batch` sequences.

    sympow: S and Z of every layer and key/value head, via `sympow.state_bytes`
      (independent of the context); bytes_per_number None = as stored (4: float32, or 8
      in float64 compute). bytes_per_number=2 reproduces the state-size table of
      [sympow] §4 (39 MB for GPT-2 small at p=2). Learned rotary's mu (Hk floats per layer)
      is not counted.
    softmax: the KV cache, n_layer * context * Hk * 2 D numbers, context None =
      config.max_length; bytes_per_number None = the compute dtype's.
    """
    for name, value in (("batch", batch), ("context", context),
                        ("bytes_per_number", bytes_per_number)):
        if name != "batch" and value is None:
            continue
        if not is_int(value) or value < 1:
            optional = "" if name == "batch" else "None or "
            raise ValueError(f"{name} must be {optional}a positive int, got {name}={value!r}")
    d, hk = config.head_dim, config.kv_heads
    if config.attention == "sympow":
        per_number = (compute_dtype(jnp.dtype(config.dtype)).itemsize
                      if bytes_per_number is None else bytes_per_number)
        return batch * embedding.state_bytes(d, config.p, e=d, layers=config.n_layer, heads=hk,
                                          bytes_per_number=per_number)
    context = config.max_length if context is None else context
    per_number = jnp.dtype(config.dtype).itemsize if bytes_per_number is None else bytes_per_number
    return batch * config.n_layer * context * hk * 2 * d * per_number


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """Parameter counts by group and the decoding state size of one sequence.

    groups: embedding (tied, so also the head), attention (q/k/v/out), gating (W_gamma, and
    b_gamma unless gate_bias is None), rotary (W_beta), mlp, norm. state_bytes:
    `state_bytes(config)`.
    """

    params: int
    groups: dict[str, int]
    state_bytes: int

    def fraction(self, group: str) -> float:
        """Share of the parameters in `group`, e.g. 0.0009 for gating in GPT-2 small."""
        return self.groups[group] / self.params


_GROUPS = (("gate_proj", "gating"), ("beta_proj", "rotary"), ("wte", "embedding"),
           ("attn", "attention"), ("fc", "mlp"), ("proj", "mlp"), ("ln", "norm"))


def model_report(config: GPTConfig) -> ModelReport:
    """Count parameters by group without allocating them (nnx.eval_shape)."""
    abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    groups = {name: 0 for _, name in _GROUPS}
    for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        names = [str(part) for part in path]
        group = next(g for key, g in _GROUPS if any(n.startswith(key) for n in names))
        groups[group] += int(leaf.size)
    return ModelReport(sum(groups.values()), groups, state_bytes(config))
