"""Text from a trained run, in the style of nanoGPT's sample.py.

    python experiments/sample.py --workdir runs/quickstart/conformal --prompt "It is a truth" \\
        --max_new_tokens 200
    python experiments/sample.py --workdir runs/quickstart/softmax --prompt "Emma" \\
        --temperature 0.8 --top_k 20 --num_samples 3 --seed 1
    python experiments/sample.py --workdir runs/c4 --temperature 0     # greedy, GPT-2 tokens

Restores a checkpoint of the run in --workdir (the latest unless --step) with the run's saved
config (WORKDIR/config.json), tokenizes --prompt with the run's tokenizer (byte level when
``model.vocab_size == 257`` and ``data.eot == 256``, as the demo trains; else the offline
GPT-2 BPE of ``sympow.data.tokenizer``), and prints each sample, the prompt followed by its
continuation, then a line of dashes. The model reads end-of-text first, then the prompt (every
training window starts with end-of-text), so an empty prompt samples from a document start.

    --max_new_tokens N   tokens to sample after the prompt (default 200)
    --temperature T      softmax(logits / T); 0 = greedy argmax (default 1.0)
    --top_k K            sample among the K most likely tokens; 0 = no limit (default)
    --num_samples S      independent samples, decoded in one batch (default 1)
    --seed N             the sampling key: the same seed gives the same text (default 0)
    --step N             the checkpoint to restore (default: the latest)

Decoding is recurrent: ``sympow.layers.generate`` (prefill over the prompt, then one decode
step per token in a jitted ``lax.scan``), with top-k and ``vocab_limit`` keeping out the GPT-2
vocabulary's padding ids 50257..vocab_size-1, which the tokenizer cannot decode. There is no
length limit:
sympow's state has a fixed size and softmax's KV cache is allocated for the prompt plus
max_new_tokens; past the training context (``data.context_size``) softmax degrades.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled sympow

from absl import app, flags  # noqa: E402

from sympow.data import AUSTEN_BYTES_EOT as BYTE_EOT  # noqa: E402
from sympow.data import AUSTEN_BYTES_VOCAB as BYTE_VOCAB  # noqa: E402
from sympow.data import EOT, gpt2_encoding  # noqa: E402

EOT_TEXT = "<|endoftext|>"
SEPARATOR = "-" * 15  # nanoGPT's


class Tokenizer:
    """Text <-> ids of a run: ``encode`` (no end-of-text), ``decode`` (end-of-text written as
    ``<|endoftext|>``), ``eot``, ``n_vocab`` (ids the model may emit: 0..n_vocab-1)."""

    name: str
    eot: int
    n_vocab: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0-255 and end-of-text 256 (the byte-level Austen store); bytes that are not
    valid UTF-8 decode to U+FFFD."""

    name, eot, n_vocab = "bytes", BYTE_EOT, BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        parts, run = [], bytearray()
        for i in ids:
            if int(i) == self.eot:
                parts += [run.decode("utf-8", errors="replace"), EOT_TEXT]
                run = bytearray()
            else:
                run.append(int(i))
        return "".join(parts) + run.decode("utf-8", errors="replace")


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE, offline (``sympow.data.tokenizer.gpt2_encoding``); a prompt's literal
    ``<|endoftext|>`` is encoded as text, not as the special token."""

    name = "gpt2"

    def __init__(self):
        self._encoding = _gpt2_encoding()
        self.eot, self.n_vocab = self._encoding.eot_token, self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._encoding.decode([int(i) for i in ids], errors="replace")


@functools.cache
def _gpt2_encoding():
    """Built once per process: sample_text makes the run's tokenizer twice (checking
    arguments, then loading the run), and building it reads and checks the BPE files."""
    return gpt2_encoding()


def run_tokenizer(config) -> Tokenizer:
    """The tokenizer of a run's config: bytes for vocabulary 257 with end-of-text 256, GPT-2
    BPE for end-of-text 50256 with a vocabulary of at least 50257 (50304: padded)."""
    vocab, eot = int(config.model.vocab_size), int(config.data.get("eot", EOT))
    if (vocab, eot) == (BYTE_VOCAB, BYTE_EOT):
        return ByteTokenizer()
    if eot == EOT and vocab >= EOT + 1:
        return GPT2Tokenizer()
    raise ValueError(f"workdir: no tokenizer for model.vocab_size={vocab}, data.eot={eot} "
                     f"(known: bytes {BYTE_VOCAB}/{BYTE_EOT}, GPT-2 >= {EOT + 1}/{EOT})")


@dataclasses.dataclass(frozen=True)
class LoadedRun:
    """A restored checkpoint: the nnx GPT, the run's config, its step and tokenizer."""

    model: object
    config: object
    step: int
    tokenizer: Tokenizer


def _is_int(value, minimum: int | None = None) -> bool:
    import numpy as np

    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and (minimum is None or value >= minimum))


def check_arguments(*, prompt="", max_new_tokens=200, temperature=1.0, top_k=0, num_samples=1,
                    seed=0, step=None) -> None:
    """ValueError naming the first bad argument (top_k's upper bound needs the run: see
    ``check_top_k``)."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt: need a string, got {prompt!r}")
    if not _is_int(max_new_tokens, 1):
        raise ValueError(f"max_new_tokens: need an int >= 1, got {max_new_tokens!r}")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature: need a finite number >= 0 (0: greedy), got "
                         f"{temperature!r}")
    if not _is_int(top_k, 0):
        raise ValueError(f"top_k: need an int >= 0 (0: no limit), got {top_k!r}")
    if not _is_int(num_samples, 1):
        raise ValueError(f"num_samples: need an int >= 1, got {num_samples!r}")
    if not _is_int(seed):
        raise ValueError(f"seed: need an int, got {seed!r}")
    if step is not None and not _is_int(step, 0):
        raise ValueError(f"step: need a checkpoint step >= 0 or None (latest), got {step!r}")


def check_top_k(top_k: int, tokenizer: Tokenizer) -> None:
    if top_k > tokenizer.n_vocab:
        raise ValueError(f"top_k: {top_k} exceeds the run's vocabulary of {tokenizer.n_vocab} "
                         f"tokens ({tokenizer.name}); 0 means no limit")


def load_run(workdir, step: int | None = None) -> LoadedRun:
    """Restores the model of checkpoint ``step`` (None: the latest) of a training run, with the
    run's config, onto the first device; FileNotFoundError if the run has no checkpoints,
    ValueError naming ``step`` if it has not that one."""
    import jax

    from sympow.train import config as configlib
    from sympow.train.checkpoint import Checkpointer, checkpoint_dir, with_sharding
    from sympow.train.model import model_def

    config = configlib.load_workdir_config(workdir)  # FileNotFoundError naming the workdir
    tokenizer = run_tokenizer(config)
    mdef = model_def(config.model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = with_sharding({"params": mdef.abstract_params, "rest": mdef.abstract_rest},
                             device)
    ckpt = Checkpointer(checkpoint_dir(workdir), read_only=True)
    try:
        available = ckpt.all_steps()
        if not available:
            raise FileNotFoundError(f"workdir: no checkpoints in {checkpoint_dir(workdir)}")
        if step is None:
            step = available[-1]
        elif step not in available:
            raise ValueError(f"step: {step} is not among the checkpoints {available} of "
                             f"{workdir}")
        restored, _ = ckpt.restore_model(step, abstract)
    finally:
        ckpt.close()
    model = mdef.merge(restored["params"], restored["rest"])
    return LoadedRun(model, config, int(step), tokenizer)


def sample_tokens(run: LoadedRun, prompt_ids, *, max_new_tokens: int = 200,
                  temperature: float = 1.0, top_k: int = 0, num_samples: int = 1,
                  seed: int = 0):
    """New token ids, int32 numpy [num_samples, max_new_tokens], after ``prompt_ids`` (the
    model's whole input: end-of-text first, as ``prompt_token_ids`` makes it). Deterministic
    given ``seed``: ``sympow.layers.generate`` with ``rng=jax.random.key(seed)``, top_k and
    the tokenizer's vocabulary as ``vocab_limit``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.layers import generate

    check_arguments(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    num_samples=num_samples, seed=seed)
    check_top_k(top_k, run.tokenizer)
    prompt = jnp.tile(jnp.asarray(prompt_ids, jnp.int32)[None], (num_samples, 1))
    if prompt.shape[1] < 1:
        raise ValueError("prompt_ids: need at least one token (end-of-text)")
    out = generate(run.model, prompt, max_new_tokens, temperature=temperature,
                   rng=jax.random.key(seed), top_k=0 if temperature == 0 else int(top_k),
                   vocab_limit=run.tokenizer.n_vocab)
    return np.asarray(jax.device_get(out[:, prompt.shape[1]:]))


def prompt_token_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """End-of-text, then the prompt's tokens: how every training window begins."""
    return [tokenizer.eot, *tokenizer.encode(prompt)]


def sample_text(workdir, prompt: str = "", *, max_new_tokens: int = 200,
                temperature: float = 1.0, top_k: int = 0, num_samples: int = 1, seed: int = 0,
                step: int | None = None) -> list[str]:
    """``num_samples`` texts, each ``prompt`` followed by its continuation, from checkpoint
    ``step`` (None: the latest) of the training run in ``workdir``. Arguments are checked
    (ValueError naming each) before the checkpoint is read."""
    from sympow.train import config as configlib

    check_arguments(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_k=top_k, num_samples=num_samples, seed=seed, step=step)
    check_top_k(top_k, run_tokenizer(configlib.load_workdir_config(workdir)))
    run = load_run(workdir, step)
    ids = prompt_token_ids(run.tokenizer, prompt)
    tokens = sample_tokens(run, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k, num_samples=num_samples, seed=seed)
    return [prompt + run.tokenizer.decode(row) for row in tokens]


_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory")
_PROMPT = flags.DEFINE_string("prompt", "", "text to continue ('': from a document start)")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 200, "tokens to sample per sample")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "softmax temperature; 0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens; 0 = all")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "independent samples")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed (same seed, same text)")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.mark_flags_as_required(["workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]} (quote the --prompt text)")
    from sympow.train.metrics import setup_logging

    setup_logging()
    try:
        texts = sample_text(_WORKDIR.value, _PROMPT.value, max_new_tokens=_MAX_NEW_TOKENS.value,
                            temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                            num_samples=_NUM_SAMPLES.value, seed=_SEED.value, step=_STEP.value)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"sample.py: {error}")
    for text in texts:
        print(text)
        print(SEPARATOR, flush=True)


if __name__ == "__main__":
    app.run(main)
