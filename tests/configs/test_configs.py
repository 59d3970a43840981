"""configs/: every config file loads with a launch command and an expected result, config
args (variant words, key=value), the model a config names (a GPTConfig preset at a size), and
sweeps."""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from configs import base
from sympow.layers import GPTConfig
from sympow.train import config as configlib
from sympow.train import data as datalib
from sympow.train.model import gpt_config, model_def
from tests.train.helpers import CONFIGS, QUICKSTART

ROOT = CONFIGS.parent


def test_config_args_and_overrides():
    config = configlib.load_config(f"{QUICKSTART}:gating,p=4,context=128",
                                   ["optim.learning_rate=1e-3", "num_train_steps=7",
                                    "data.path=/somewhere/else"])
    assert (config.variant, config.model.p, config.model.gating, config.model.rotary) == (
        "sympow_gating", 4, True, "fixed")  # the preset name of the word 'gating'
    assert config.data.context_size == 128 and config.num_train_steps == 7
    assert config.optim.learning_rate == 1e-3 and config.data.path == "/somewhere/else"
    with pytest.raises(ValueError, match="unknown word"):
        configlib.load_config(f"{QUICKSTART}:nonsense")
    with pytest.raises(ValueError, match="p must be a positive even int"):
        configlib.load_config(f"{QUICKSTART}:p=3")
    with pytest.raises(ValueError, match="no field"):
        configlib.apply_override(config, "optim.nope=1")


def test_every_config_loads():
    for path in sorted((ROOT / "configs").glob("*.py")):
        module = configlib.load_module(path)
        if not hasattr(module, "get_config"):
            continue
        assert "python experiments/" in module.__doc__, f"{path.name}: no launch command"
        assert "Expected result" in module.__doc__, f"{path.name}: no expected result"
        for arg in (None, "runlocal"):
            config = module.get_config(arg)
            assert config.num_train_steps > 0 and config.data.docs_per_batch > 0
            assert config.data.path == str(datalib.AUSTEN_PATH)
        if hasattr(module, "get_sweep"):
            runs = module.get_sweep("runlocal")
            assert {c.variant for c in runs} == {"softmax", "sympow", "sympow_gating",
                                                 "conformal"}
    paper = configlib.load_config(f"{ROOT / 'configs' / 'sweep_p4.py'}:sympow,context=65536")
    assert paper.data.docs_per_batch * paper.data.context_size == 524288
    assert paper.optim.learning_rate == 6e-4 and paper.optim.schedule == "constant"
    assert (paper.model.n_layer, paper.model.d_model, paper.model.p) == (12, 768, 4)


def test_config_arg_words_and_typed_values():
    args = base.parse_arg("gating,p=4,context=1024,runlocal", variant="conformal", p=2,
                          context=256, runlocal=False)
    assert args == {"variant": "sympow_gating", "p": 4, "context": 1024, "runlocal": True}
    assert base.parse_arg("variant=conformal-sympow", variant="sympow")["variant"] == "conformal"
    assert base.parse_arg(None, variant="sympow", p=2) == {"variant": "sympow", "p": 2}
    with pytest.raises(ValueError, match="unknown key 'q'"):
        base.parse_arg("q=1", p=2)
    with pytest.raises(ValueError, match="config arg: variant 'mamba' not in"):
        base.parse_arg("variant=mamba", variant="sympow")


def _shape(model):
    return (model.n_layer, model.n_head, model.n_kv_head, model.d_model)


@pytest.mark.parametrize("word, preset", [("softmax", "softmax"), ("sympow", "sympow"),
                                          ("gating", "sympow_gating"), ("conformal", "conformal")])
def test_config_model_is_the_named_preset(word, preset):
    """config.model holds GPTConfig fields: the preset's, at the config's size."""
    config = configlib.load_config(f"{CONFIGS / 'gpt2_context4096.py'}:{word},p=6")
    assert config.variant == preset
    built = gpt_config(config.model)
    want = GPTConfig.preset(preset, "small", p=6, n_kv_head=12, dtype=built.dtype,
                            param_dtype=built.param_dtype)
    assert built == want
    assert set(config.model.keys()) <= {f.name for f in dataclasses.fields(GPTConfig)}
    assert _shape(config.model) == (12, 12, 12, 768)  # GPT-2 small
    assert (config.model.dtype, config.model.param_dtype) == ("bfloat16", "float32")


def test_gate_bias_field_and_the_papers_form(tmp_path):
    """config.model.gate_bias is explicit (5.0); None (the papers' bias-free gate) builds a
    model without b_gamma, also from absl's ``--config.model.gate_bias=None`` (the field
    takes any literal) and through the workdir copy; a wrong type fails ``validate``."""
    assert configlib.load_config(f"{QUICKSTART}:gating").model.gate_bias == 5.0
    config = configlib.load_config(f"{QUICKSTART}:gating,runlocal",
                                   ["model.gate_bias=None", "optim.grad_clip=0"])
    assert config.model.gate_bias is None and config.optim.grad_clip == 0.0
    assert gpt_config(config.model).gate_bias is None
    params = model_def(config.model).abstract_params
    names = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(params)]
    gate = [n for n in names if "gate_proj" in n]
    assert gate and all(n.endswith("kernel") for n in gate)
    back = configlib.load_workdir_config(configlib.save_config(config, tmp_path).parent)
    configlib.validate(back)
    assert back.model.gate_bias is None

    def parse(*overrides):  # as experiments/train.py parses its command line
        argv = ["train.py", f"--config={QUICKSTART}:gating,runlocal", *overrides]
        values = flags.FlagValues()
        flag = config_flags.DEFINE_config_file("config", None, "config", flag_values=values,
                                               lock_config=True, sys_argv=argv)
        values(argv)
        return flag.value

    for override, want in (("--config.model.gate_bias=None", None),
                           ("--config.model.gate_bias=0.0", 0.0),
                           ("--config.model.gate_bias=-1", -1), ("--config.seed=0", 5.0)):
        config = parse(override)
        assert config.model.gate_bias == want, override
        configlib.validate(config)
        assert gpt_config(config.model).gate_bias == want
    with pytest.raises(ValueError, match="model.gate_bias: need a finite number or None"):
        configlib.validate(parse("--config.model.gate_bias=x"))


def test_sizes_of_the_quickstart_and_runlocal():
    assert _shape(configlib.load_config(QUICKSTART).model) == (2, 4, 4, 128)  # 'tiny'
    for path in sorted(CONFIGS.glob("*.py")):
        module = configlib.load_module(path)
        if hasattr(module, "get_config"):  # 'micro': runlocal's CPU smoke model
            assert _shape(module.get_config("runlocal").model) == (2, 2, 2, 64), path.name
    assert base.size_fields("small") == {"n_layer": 12, "n_head": 12, "n_kv_head": 12,
                                         "d_model": 768}
    with pytest.raises(ValueError, match="size: 'huge'"):
        base.size_fields("huge")


def test_sweep_variants_accept_aliases():
    module = configlib.load_module(CONFIGS / "sweep_p2.py")
    runs = module.get_sweep("variants=gating+softmax,contexts=512,runlocal")
    assert [(c.variant, c.data.context_size) for c in runs] == [("sympow_gating", 512),
                                                                ("softmax", 512)]
    with pytest.raises(ValueError, match="sweep arg: variant 'mamba'"):
        module.get_sweep("variants=softmax+mamba")


def test_quickstart_bytes_reads_the_byte_corpus():
    """The demo's corpus: the byte-level store, vocabulary 257 with end-of-text 256."""
    from sympow.data import AUSTEN_BYTES_PATH

    config = configlib.load_config(f"{QUICKSTART}:softmax,bytes")
    assert config.data.path == str(AUSTEN_BYTES_PATH)
    assert (config.model.vocab_size, config.data.eot) == (257, 256)
    assert config.num_train_steps == 800
    assert configlib.load_config(QUICKSTART).data.eot == 50256
    local = configlib.load_config(f"{QUICKSTART}:bytes,runlocal")
    assert (local.data.path, local.data.eot, local.model.vocab_size) == (
        str(AUSTEN_BYTES_PATH), 256, 257)
    assert _shape(local.model) == (2, 2, 2, 64)
    configlib.validate(local)
    with pytest.raises(ValueError, match=r"data.eot: 300 must be below model.vocab_size 257"):
        configlib.load_config(f"{QUICKSTART}:bytes", ["data.eot=300"])
