"""experiments/model_benchmark.py on the CPU at size 'micro': a training, a batched decoding
and an inference-forward case each run in their own process and report what they measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent
SCRIPT = ROOT / "experiments" / "model_benchmark.py"


def test_train_decode_and_forward_cases(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--size=micro", "--train=softmax:0:64", "--steps=3",
         "--tokens=256", "--decode=conformal:2:64:2", "--new_tokens=4",
         "--decode_impls=reference,pallas",
         "--forward=conformal:2:64", "--reps=2", f"--out={tmp_path}", "--timeout=240"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "model_benchmark.json").read_text())
    assert [r["kind"] for r in results] == ["train", "decode", "decode", "forward"]
    assert not [r for r in results if "error" in r], results
    train, decode, fused, forward = results
    assert (decode["decode_impl"], fused["decode_impl"]) == ("reference", "pallas")
    assert fused["tokens_shape"] == decode["tokens_shape"]
    assert train["rows"] == 4 and len(train["losses"]) == 3 and train["finite"]
    assert decode["batch"] == 2 and decode["tokens_shape"] == [2, 68]
    # tokens/s is batch x new tokens over the decode time: (generate - prefill) / new tokens
    decode_s = decode["ms_per_token"] * 4 / 1e3
    assert decode["tokens_per_s"] == pytest.approx(2 * 4 / decode_s, rel=0.01)
    assert forward["rows"] == 4 and forward["forward_ms"] > 0
    assert forward["tokens_per_s"] == pytest.approx(4 * 64 / forward["forward_ms"] * 1e3,
                                                    rel=0.01)


def test_bad_case_specs_fail_before_any_run(tmp_path):
    for flag, spec in (("--decode", "conformal:2:64:0"), ("--forward", "conformal:2:64:2"),
                       ("--train", "conformal:two:64")):
        done = subprocess.run([sys.executable, str(SCRIPT), "--train=", f"{flag}={spec}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and f"case '{spec}'" in done.stderr, (flag, done.stderr)
    done = subprocess.run([sys.executable, str(SCRIPT), "--train=", "--decode_impls=xla"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--decode_impls: each of reference, pallas" in done.stderr
