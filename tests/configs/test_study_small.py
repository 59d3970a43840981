"""configs/study_small.py: the small-scale study's parts, in the papers' form, and a CPU smoke
run of one part through the sweep."""

from __future__ import annotations

import pytest

from sympow.train import config as configlib
from sympow.train.sweep import read_csv, run_sweep
from tests.train.helpers import CONFIGS

STUDY = CONFIGS / "study_small.py"


def sweep(arg):
    return configlib.load_module(STUDY).get_sweep(arg)


def test_parts_are_the_studys_runs_in_the_papers_form():
    contexts = sweep("part=contexts")
    assert sorted((c.variant, c.data.context_size) for c in contexts) == sorted(
        (v, t) for v in ("softmax", "sympow", "sympow_gating", "conformal")
        for t in (256, 1024, 4096))
    for config in contexts + sweep("part=seeds") + sweep("part=p4"):
        configlib.validate(config)
        assert (config.model.n_layer, config.model.n_head, config.model.d_model) == (4, 4, 256)
        assert config.data.docs_per_batch * config.data.context_size == 65536
        assert config.optim.learning_rate == 6e-4 and config.optim.schedule == "constant"
        assert config.model.gate_bias is None and config.optim.grad_clip == 0
        assert config.eval.length == config.data.context_size
    assert {c.seed for c in sweep("part=seeds")} == {1}
    assert {(c.variant, c.model.p) for c in sweep("part=p4")} == {
        ("sympow", 4), ("sympow_gating", 4), ("conformal", 4)}


def test_each_deviation_changes_exactly_its_field():
    paper, = [c for c in sweep("part=contexts")
              if c.variant == "conformal" and c.data.context_size == 1024]
    for part, change in (("gate_bias", "model.gate_bias: None -> 5.0"),
                         ("clip", "optim.grad_clip: 0.0 -> 1.0")):
        run, = sweep(f"part={part}")
        configlib.validate(run)
        assert configlib.diff(configlib.to_dict(paper), configlib.to_dict(run)) == [change]


def test_a_part_split_by_context_and_variant():
    runs = sweep("part=contexts,contexts=1024,variants=softmax+conformal")
    assert [(c.variant, c.data.context_size) for c in runs] == [("softmax", 1024),
                                                                ("conformal", 1024)]
    runs = sweep("part=contexts,contexts=256+4096,variants=sympow")
    assert [(c.variant, c.data.context_size) for c in runs] == [("sympow", 256),
                                                                ("sympow", 4096)]
    with pytest.raises(ValueError, match=r"contexts \[512\] not in this part's"):
        sweep("part=contexts,contexts=512")
    with pytest.raises(ValueError, match=r"variants \['softmax'\] not in this part's"):
        sweep("part=p4,variants=softmax")


def test_unknown_part_or_deviation():
    with pytest.raises(ValueError, match="part 'nope' not in"):
        sweep("part=nope")
    with pytest.raises(ValueError, match="deviation 'huge' not in"):
        configlib.load_module(STUDY).get_config("deviation=huge")


def test_a_part_runs_on_cpu(tmp_path):
    rows = run_sweep(f"{STUDY}:part=gate_bias,runlocal,steps=3", tmp_path, eval_windows=1,
                     progress=False)
    assert [(r["variant"], r["context"], r["steps"]) for r in rows] == [("conformal", 64, 3)]
    assert read_csv(tmp_path / "sweep.csv")[0]["final_loss"] == pytest.approx(
        rows[0]["final_loss"])
