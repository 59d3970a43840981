"""Experiment configs: loading ``configs/*.py[:arg]`` files, overrides, and the workdir copy.

A config is an ``ml_collections.ConfigDict`` (see ``configs/base.py`` for its fields). Every
training run writes its config to ``<workdir>/config.json`` at start, so that evaluation and
sweeps rebuild exactly the model that was trained.

``validate`` checks a config as it will be trained, after every override (``load_config`` and
``sympow.train.trainer.train`` both call it: ``--config.a.b=value`` flags of
``experiments/train.py`` are applied by absl, not by ``load_config``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import ml_collections

from sympow.layers import PRESETS
from sympow.layers.attention import check_gate_bias
from sympow.train.optim import check_optim

CONFIG_FILE = "config.json"


def _ensure_repo_on_path(config_file: Path) -> None:
    """Config files import ``configs.base``: put the folder above ``configs/`` on sys.path."""
    root = str(config_file.resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)


def load_module(path: str | os.PathLike):
    """Imports a config file by path (the way ``config_flags.DEFINE_config_file`` does)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config: no such file {path}")
    _ensure_repo_on_path(path)
    name = f"_sympow_config_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def split_spec(spec: str) -> tuple[str, str | None]:
    """``'configs/x.py:arg'`` -> ``('configs/x.py', 'arg')``; no colon -> arg None."""
    path, sep, arg = str(spec).partition(":")
    return path, (arg if sep else None)


def load_config(spec: str,
                overrides: list[str] | tuple[str, ...] = ()) -> ml_collections.ConfigDict:
    """Loads ``path.py[:arg]`` by calling its ``get_config(arg)``, then applies ``key=value``
    overrides (the same syntax as ``--config.key=value``)."""
    path, arg = split_spec(spec)
    module = load_module(path)
    config = module.get_config(arg) if arg is not None else module.get_config()
    for item in overrides:
        apply_override(config, item)
    validate(config)
    return config


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _accepted_by(check, value) -> bool:
    """Whether the library's own check (raising ValueError) accepts ``value``."""
    try:
        check(value)
    except ValueError:
        return False
    return True


_POSITIVE_INT = (lambda x: _is_int(x) and x > 0, "a positive int")
_NONNEGATIVE_INT = (lambda x: _is_int(x) and x >= 0, "an int >= 0")
# Dotted field -> (test, what it needs). Fields a config lacks are skipped (older configs);
# a None value is allowed where None has a meaning (max_checkpoints: keep all, etc.).
_RULES = {
    "num_train_steps": _NONNEGATIVE_INT,
    "log_every": _POSITIVE_INT,
    "checkpoint_every": _POSITIVE_INT,
    "microbatches": _POSITIVE_INT,
    "max_checkpoints": (lambda x: x is None or _is_int(x) and x > 0, "a positive int or None"),
    "keep_checkpoint_period": (lambda x: x is None or _is_int(x) and x >= 0,
                               "an int >= 0 (0: none)"),
    "final_loss_steps": (_NONNEGATIVE_INT[0], "an int >= 0 (0: the last 10% of steps)"),
    "max_loss_ratio": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
                       and (x == 0 or 1 < x < math.inf), "0 (check off) or a number > 1"),
    "model.p": (lambda x: _is_int(x) and x > 0 and x % 2 == 0, "a positive even int"),
    "model.chunk_size": (lambda x: x is None or _is_int(x) and x > 0, "a positive int or None"),
    "model.gate_bias": (lambda x: _accepted_by(check_gate_bias, x),
                        "a finite number or None (no gate bias: the papers' gate)"),
    "data.context_size": _POSITIVE_INT,
    "data.docs_per_batch": _POSITIVE_INT,
    "data.prefetch": _NONNEGATIVE_INT,
    "data.eot": (lambda x: _is_int(x) and 0 <= x < 2**16, "a token id in [0, 65536)"),
    "eval.length": _POSITIVE_INT,
    "eval.num_windows": _POSITIVE_INT,
    "eval.batch_size": _POSITIVE_INT,
}
_MISSING = object()


def _lookup(config, dotted: str):
    node = config
    for name in dotted.split("."):
        if not hasattr(node, "get") or name not in node:
            return _MISSING
        node = node[name]
    return node


def check_variant(config) -> None:
    """``config.variant`` must name the ``sympow.layers.PRESETS`` entry the model is: it labels
    the run (summaries, sweep folders, plots), so a name that disagrees with the model would
    mislabel what was trained."""
    variant = config.get("variant")
    if variant not in PRESETS:
        raise ValueError(f"variant: {variant!r} not in {sorted(PRESETS)}; choose it with the "
                         "config arg (e.g. configs/quickstart.py:softmax), which also sets "
                         "the model's attention, gating and rotary")
    model = config.get("model", {})
    differ = {k: model.get(k) for k, v in PRESETS[variant].items() if model.get(k) != v}
    if differ:
        raise ValueError(f"variant: {variant!r} is the preset {PRESETS[variant]}, but the model "
                         f"has {differ}; choose the variant with the config arg (e.g. "
                         "configs/quickstart.py:softmax) rather than --config.variant")


def validate(config) -> None:
    """Raises ValueError naming the first field of a training config that is invalid: an
    unknown variant or one that is not the model's preset, out-of-range counts, optimizer
    settings (``sympow.train.optim.check_optim``). Model shapes, dtypes and data paths are
    checked where they are used (``sympow.layers.GPTConfig``, ``sympow.data.LongCrawl64``),
    before the first step."""
    check_variant(config)
    for dotted, (ok, need) in _RULES.items():
        value = _lookup(config, dotted)
        if value is not _MISSING and not ok(value):
            raise ValueError(f"{dotted}: need {need}, got {value!r}")
    eot, vocab = _lookup(config, "data.eot"), _lookup(config, "model.vocab_size")
    if eot is not _MISSING and vocab is not _MISSING and not eot < vocab:
        raise ValueError(f"data.eot: {eot} must be below model.vocab_size {vocab} (it is the "
                         "first input of every window)")
    check_optim(config.optim)


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string such as softmax or /path/to/data


def apply_override(config: ml_collections.ConfigDict, item: str) -> None:
    """Applies one ``'a.b.c=value'`` override in place; the field must exist."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ValueError(f"override: {item!r} is not key=value")
    *parents, leaf = key.strip().split(".")
    node = config
    for name in parents:
        if name not in node:
            raise ValueError(f"override: {key!r}: no field {name!r}")
        node = node[name]
    if leaf not in node:
        raise ValueError(f"override: {key!r}: no field {leaf!r} (fields: {sorted(node.keys())})")
    value = _parse_value(text)
    current = node[leaf]
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, str) and not isinstance(value, str):
        value = text
    node[leaf] = value


def to_dict(config) -> dict:
    """Plain nested dict (JSON-serializable) of a ConfigDict."""
    return json.loads(config.to_json_best_effort()) if hasattr(config, "to_json_best_effort") \
        else json.loads(json.dumps(config))


def save_config(config, workdir: str | os.PathLike) -> Path:
    """Writes ``<workdir>/config.json``; returns its path."""
    path = Path(workdir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_dict(config), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load_workdir_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
    """The config a training run saved in its workdir."""
    path = Path(workdir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"workdir: {workdir} has no {CONFIG_FILE} (not a training run?)")
    try:
        return ml_collections.ConfigDict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"workdir: {path} is not a readable JSON config ({error})") from error


def diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    keys = sorted(set(old) | set(new))
    out = []
    for key in keys:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out
