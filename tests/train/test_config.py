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
