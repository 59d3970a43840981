"""experiments/sample.py: text from tiny trained runs. Greedy decoding (recurrent prefill and
decode steps) against a greedy loop over the model's full forward pass, top-k, seeds, the
library's ``generate``, the byte-level and GPT-2 tokenizers, bad arguments (each a ValueError
naming it) and the command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sympow.data import AUSTEN_BYTES_PATH
from sympow.data.tokenizer import gpt2_encoding
from sympow.layers import generate
from sympow.train.trainer import train
from tests.train.helpers import QUICKSTART, ROOT, tiny_config

SCRIPT = ROOT / "experiments" / "sample.py"
_spec = importlib.util.spec_from_file_location("sympow_sample_script", SCRIPT)
sample = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # for dataclasses
_spec.loader.exec_module(sample)

ONE_STEP = ["num_train_steps=1", "checkpoint_every=1", "log_every=1"]
PROMPT = "It is a truth"


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A one-step conformal-sympow run on the byte-level corpus (vocabulary 257)."""
    workdir = tmp_path_factory.mktemp("bytes")
    config = tiny_config(f"{QUICKSTART}:conformal,bytes,runlocal", ONE_STEP)
    assert config.data.path == str(AUSTEN_BYTES_PATH)
    train(config, workdir, progress=False)
    return workdir


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A one-step softmax run on GPT-2 tokens (vocabulary 50304: 47 padding ids)."""
    workdir = tmp_path_factory.mktemp("gpt2")
    train(tiny_config(overrides=ONE_STEP), workdir, progress=False)
    return workdir


def full_forward(model):
    """The model's forward pass (``model(tokens)``: no cache) as a jitted function of the
    tokens [B, T]."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: forward(state, np.asarray(tokens, np.int32))


def greedy_full_forward(model, ids, n: int, n_vocab: int) -> list[int]:
    """n greedy tokens, each the argmax of the model's full forward pass (no cache) at the last
    position of the growing sequence; asserts no near tie makes the argmax ill-defined. The
    sequence is padded to its final length, which the causal model never reads from earlier
    positions, so that one jit compilation serves every step."""
    forward = full_forward(model)
    tokens = np.full((1, len(ids) + n), ids[0], np.int32)
    tokens[0, :len(ids)] = ids
    for i in range(len(ids), len(ids) + n):
        logits = np.asarray(forward(tokens), np.float64)[0, i - 1, :n_vocab]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-4, "near tie: pick another prompt"
        tokens[0, i] = np.argmax(logits)
    return tokens[0, len(ids):].tolist()


def scrambled(run, scale: float = 0.1, attention_scale: float = 1.0):
    """The run with normal noise added to every parameter, of std ``attention_scale`` in the
    attention layers and ``scale`` elsewhere. After one training step greedy decoding repeats
    the last token (the tied embedding dominates) whatever attention computes; with these
    weights the continuation depends on the whole context."""
    graphdef, params, rest = nnx.split(run.model, nnx.Param, ...)
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(0), len(paths))
    noisy = [x + (attention_scale if "attn" in jax.tree_util.keystr(path) else scale)
             * jax.random.normal(k, x.shape, x.dtype)
             for (path, x), k in zip(paths, keys, strict=True)]
    return dataclasses.replace(run, model=nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy),
                                                    rest))


@pytest.mark.parametrize("which", ["byte_run", "gpt2_run"])
def test_greedy_matches_full_forward_and_top1(which, request):
    run = scrambled(sample.load_run(request.getfixturevalue(which)))
    ids = sample.prompt_token_ids(run.tokenizer, PROMPT)
    assert ids[0] == run.tokenizer.eot and len(ids) > 1
    want = greedy_full_forward(run.model, ids, 8, run.tokenizer.n_vocab)
    assert len(set(want)) >= 3
    # the context matters: the prompt's last token alone continues differently
    assert greedy_full_forward(run.model, [ids[0], ids[-1]], 8, run.tokenizer.n_vocab) != want
    greedy = sample.sample_tokens(run, ids, max_new_tokens=8, temperature=0, num_samples=2)
    assert greedy.tolist() == [want, want]
    top1 = sample.sample_tokens(run, ids, max_new_tokens=8, temperature=1.0, top_k=1, seed=5)
    assert top1.tolist() == [want]


def test_seeds_top_k_and_generate(byte_run):
    run = sample.load_run(byte_run)
    ids = sample.prompt_token_ids(run.tokenizer, PROMPT)

    def draw(**kwargs):
        return sample.sample_tokens(run, ids, max_new_tokens=32, **kwargs)

    first = draw(seed=0, num_samples=2)
    assert np.array_equal(first, draw(seed=0, num_samples=2))  # deterministic
    assert not np.array_equal(first[0], draw(seed=1)[0])
    assert not np.array_equal(first[0], first[1])  # the samples of a batch are independent
    # top_k 0: exactly the library's generate with the same key
    library = generate(run.model, np.asarray([ids] * 2), 32, temperature=1.0,
                       rng=jax.random.key(0))
    assert np.array_equal(np.asarray(library)[:, len(ids):], first)
    # top_k 3: every token among the 3 most likely at its position (one full forward)
    picked = draw(seed=2, temperature=2.0, top_k=3)[0]
    logits = np.asarray(full_forward(run.model)([[*ids, *picked]]))[0]
    for i, token in enumerate(picked):
        assert token in np.argsort(logits[len(ids) - 1 + i])[-3:]


def test_byte_text(byte_run):
    texts = sample.sample_text(byte_run, PROMPT, max_new_tokens=16, temperature=0.7, seed=3,
                               num_samples=2)
    run = sample.load_run(byte_run)
    assert isinstance(run.tokenizer, sample.ByteTokenizer)
    tokens = sample.sample_tokens(run, sample.prompt_token_ids(run.tokenizer, PROMPT),
                                  max_new_tokens=16, temperature=0.7, seed=3, num_samples=2)
    for text, row in zip(texts, tokens, strict=True):
        assert text == PROMPT + run.tokenizer.decode(row)
    tokenizer = sample.ByteTokenizer()
    assert tokenizer.encode("é!") == [0xC3, 0xA9, 0x21]
    assert tokenizer.decode([104, 105, 256, 0xC3, 0xA9, 0xFF]) == "hi<|endoftext|>é\ufffd"
    assert sample.sample_text(byte_run, "", max_new_tokens=4, temperature=0)[0]  # EOT alone


def test_gpt2_text(gpt2_run):
    run = sample.load_run(gpt2_run, step=1)
    assert isinstance(run.tokenizer, sample.GPT2Tokenizer) and run.step == 1
    ids = sample.prompt_token_ids(run.tokenizer, PROMPT)
    assert ids == [50256, *gpt2_encoding().encode(PROMPT)]
    tokens = sample.sample_tokens(run, ids, max_new_tokens=12, seed=4)
    assert tokens.max() < 50257  # never a padding id
    text = sample.sample_text(gpt2_run, PROMPT, max_new_tokens=12, seed=4, step=1)
    assert text == [PROMPT + gpt2_encoding().decode(tokens[0].tolist(), errors="replace")]


@pytest.mark.parametrize("name,value", [
    ("max_new_tokens", 0), ("max_new_tokens", 2.0), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_k", -1),
    ("top_k", 258), ("num_samples", 0), ("seed", 1.5), ("step", -1), ("step", 99),
    ("prompt", None),
])
def test_bad_arguments(byte_run, name, value):
    kwargs = {"max_new_tokens": 4, name: value}
    with pytest.raises(ValueError, match=f"^{name}: "):
        sample.sample_text(byte_run, **kwargs)


def test_command_line(byte_run):
    cmd = [sys.executable, str(SCRIPT), f"--workdir={byte_run}", f"--prompt={PROMPT}",
           "--max_new_tokens=8", "--temperature=0.8", "--top_k=5", "--num_samples=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    samples = done.stdout.split(sample.SEPARATOR + "\n")
    assert len(samples) == 3 and samples[-1] == ""
    assert all(s.startswith(PROMPT) for s in samples[:2])
    bad = subprocess.run([*cmd, "--top_k=999"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert bad.returncode != 0 and "top_k: 999 exceeds" in bad.stderr
