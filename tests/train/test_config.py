"""sympow.train.config: loading ``path.py[:arg]``, ``key=value`` overrides and their typing,
the workdir copy of a config and the diff shown on resume."""

from __future__ import annotations

import ml_collections
import pytest

from sympow.train import config as configlib
from tests.train.helpers import QUICKSTART


def _config():
    return ml_collections.ConfigDict({
        "steps": 10, "name": "softmax", "flag": False,
        "optim": {"learning_rate": 6e-4, "schedule": "constant"},
    })


def test_split_spec():
    assert configlib.split_spec("configs/x.py:a,b=1") == ("configs/x.py", "a,b=1")
    assert configlib.split_spec("configs/x.py:") == ("configs/x.py", "")
    assert configlib.split_spec("configs/x.py") == ("configs/x.py", None)


def test_overrides_are_typed_like_the_field():
    config = _config()
    configlib.apply_override(config, "optim.learning_rate=1")  # an int for a float field
    assert config.optim.learning_rate == 1.0 and isinstance(config.optim.learning_rate, float)
    configlib.apply_override(config, "steps=25")
    configlib.apply_override(config, "flag=True")
    configlib.apply_override(config, "name=123")  # a string field keeps the text
    configlib.apply_override(config, "optim.schedule=cosine")  # bare words are strings
    assert (config.steps, config.flag, config.name, config.optim.schedule) == (
        25, True, "123", "cosine")


@pytest.mark.parametrize("item, match", [
    ("steps", "is not key=value"),
    ("nope=1", "no field 'nope'"),
    ("optim.nope=1", "no field 'nope'"),
    ("model.n_layer=1", "no field 'model'"),
])
def test_bad_overrides_raise(item, match):
    with pytest.raises(ValueError, match=match):
        configlib.apply_override(_config(), item)


def test_load_config_applies_overrides_in_order():
    config = configlib.load_config(QUICKSTART, ["num_train_steps=7", "num_train_steps=9"])
    assert config.num_train_steps == 9
    with pytest.raises(ValueError, match="no such file"):
        configlib.load_config("configs/does_not_exist.py")


def test_workdir_copy_round_trip_and_diff(tmp_path):
    config = _config()
    path = configlib.save_config(config, tmp_path / "run")
    assert path == tmp_path / "run" / configlib.CONFIG_FILE
    back = configlib.load_workdir_config(tmp_path / "run")
    assert configlib.to_dict(back) == {"steps": 10, "name": "softmax", "flag": False,
                                       "optim": {"learning_rate": 6e-4, "schedule": "constant"}}
    changed = configlib.to_dict(back)
    changed["optim"]["learning_rate"] = 1e-3
    changed["extra"] = 1
    assert configlib.diff(configlib.to_dict(config), changed) == [
        "extra: None -> 1", "optim.learning_rate: 0.0006 -> 0.001"]
    with pytest.raises(FileNotFoundError, match="not a training run"):
        configlib.load_workdir_config(tmp_path / "elsewhere")


def test_a_corrupt_workdir_config_names_its_file(tmp_path):
    """A config.json cut short (an interrupted copy) is a ValueError naming the file, not a
    bare JSONDecodeError."""
    (tmp_path / configlib.CONFIG_FILE).write_text('{"steps": 10, "name"')
    with pytest.raises(ValueError, match=r"workdir: .*config.json is not a readable JSON "
                                         r"config \(Expecting"):
        configlib.load_workdir_config(tmp_path)


@pytest.mark.parametrize("override, match", [
    ("variant=flash", r"variant: 'flash' not in \['conformal', 'softmax', 'sympow', "
                      r"'sympow_gating'\]; choose it with the config arg"),
    # A preset name that is not the model's would mislabel the run (summaries, sweeps, plots).
    ("variant=softmax", r"variant: 'softmax' is the preset .* but the model has "
                        r"\{'attention': 'sympow', 'gating': True, 'rotary': 'learned'\}"),
    ("model.rotary=fixed", r"variant: 'conformal' is the preset .* \{'rotary': 'fixed'\}"),
    ("num_train_steps=-1", "num_train_steps: need an int >= 0, got -1"),
    ("microbatches=0", "microbatches: need a positive int, got 0"),
    ("max_checkpoints=0", "max_checkpoints: need a positive int or None, got 0"),
    ("keep_checkpoint_period=-5", r"keep_checkpoint_period: need an int >= 0 \(0: none\)"),
    ("final_loss_steps=-1", "final_loss_steps: need an int >= 0"),
    ("max_loss_ratio=0.5", r"max_loss_ratio: need 0 \(check off\) or a number > 1, got 0.5"),
    ("model.p=3", "model.p: need a positive even int, got 3"),
    ("model.gate_bias=abc", r"model.gate_bias: need a finite number or None .*, got 'abc'"),
    ("model.gate_bias=True", r"model.gate_bias: need a finite number or None .*, got True"),
    ("model.gate_bias=1e999", r"model.gate_bias: need a finite number or None .*, got inf"),
    ("data.docs_per_batch=-4", "data.docs_per_batch: need a positive int, got -4"),
    ("eval.batch_size=-1", "eval.batch_size: need a positive int, got -1"),
    ("optim.learning_rate=-1", r"optim.learning_rate: need a finite number > 0, got -1.0"),
    ("optim.learning_rate=1e999", r"optim.learning_rate: need a finite number > 0, got inf"),
    ("optim.b1=2", r"optim.b1: need a number in \[0, 1\), got 2.0"),
    ("optim.grad_clip=-1", r"optim.grad_clip: need a finite number >= 0 \(0: no clipping\)"),
    ("optim.warmup_steps=-3", "optim.warmup_steps: need an int >= 0, got -3"),
    ("optim.schedule=linear", "optim.schedule: 'linear' not in"),
])
def test_the_resolved_config_is_validated(override, match):
    """``load_config`` checks the config after its overrides; ``validate`` is what
    ``train`` calls on a config from absl's ``--config.a.b=value`` flags."""
    with pytest.raises(ValueError, match=match):
        configlib.load_config(QUICKSTART, [override])
    config = configlib.load_config(QUICKSTART)
    configlib.apply_override(config, override)  # as absl's flags do: no validation
    with pytest.raises(ValueError, match=match):
        configlib.validate(config)


def test_max_checkpoints_none_and_defaults_are_valid():
    config = configlib.load_config(QUICKSTART, ["max_checkpoints=None", "max_loss_ratio=0"])
    assert config.max_checkpoints is None and config.max_loss_ratio == 0.0
    del config["max_loss_ratio"]  # a config saved before the field existed
    configlib.validate(config)
