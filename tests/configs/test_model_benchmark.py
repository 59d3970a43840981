"""experiments/model_benchmark.py on the CPU at size 'micro': a training, a batched decoding
and an inference-forward case each run in their own process and report what they measured;
a start-up case launches train.py twice on one compilation cache."""

from __future__ import annotations

import importlib.util
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
         "--decode_impls=reference,pallas", "--decode_steps=blocks,fused",
         "--forward=conformal:2:64", "--reps=2", f"--out={tmp_path}", "--timeout=240"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "model_benchmark.json").read_text())
    assert [r["kind"] for r in results] == ["train"] + ["decode"] * 4 + ["forward"]
    assert not [r for r in results if "error" in r], results
    train, decode, *_, forward = results
    assert [(r["decode_impl"], r["decode_step"]) for r in results[1:5]] == [
        ("reference", "blocks"), ("reference", "fused"), ("pallas", "blocks"),
        ("pallas", "fused")]
    # (counted on the CPU's program, where the interpreter unrolls each kernel into XLA
    # loops: the GPU's counts are in docs/benchmarks.md)
    assert all(r["launches_per_step"] > 0 for r in results[1:5])
    assert {tuple(r["tokens_shape"]) for r in results[1:5]} == {tuple(decode["tokens_shape"])}
    # three steps waited for one by one, then the same three dispatched back to back
    assert train["rows"] == 4 and len(train["losses"]) == 6 and train["finite"]
    assert train["pipelined_tokens_per_s"] == pytest.approx(
        4 * 64 / train["pipelined_step_ms"] * 1e3, rel=0.01)
    assert train["steady_tokens_per_s"] == pytest.approx(
        4 * 64 / train["steady_step_ms"] * 1e3, rel=0.01)
    # two of three steps' times against three: no more than 3/2 the pipelined mean
    assert 0 < train["steady_step_ms"] <= 1.5 * train["pipelined_step_ms"]
    # each back-to-back call's return time, none longer than the whole pass
    assert len(train["dispatch_ms"]) == 3
    assert 0 < max(train["dispatch_ms"]) <= 3 * train["pipelined_step_ms"]
    assert decode["batch"] == 2 and decode["tokens_shape"] == [2, 68]
    # tokens/s is the batch over a step's time: generate(8) - generate(4) over 4 tokens;
    # the rest of a call is what it does once besides its prefill and its 4 steps
    assert decode["tokens_per_s"] == pytest.approx(2 / decode["ms_per_token"] * 1e3, rel=0.01)
    assert decode["call_overhead_ms"] == pytest.approx(
        decode["generate_ms"] - decode["prefill_ms"] - 4 * decode["ms_per_token"], abs=0.2)
    assert decode["ms_per_token_in_call"] == pytest.approx(
        (decode["generate_ms"] - decode["prefill_ms"]) / 4, abs=0.1)
    assert decode["split_ms"] > 0
    assert forward["rows"] == 4 and forward["forward_ms"] > 0
    assert forward["tokens_per_s"] == pytest.approx(4 * 64 / forward["forward_ms"] * 1e3,
                                                    rel=0.01)


def test_startup_case_launches_train_py_cold_then_warm(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--train=", "--startup=softmax:0:32",
         "--startup_config=configs/quickstart.py:runlocal", "--tokens=64", f"--out={tmp_path}",
         "--timeout=240"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads((tmp_path / "model_benchmark.json").read_text())
    assert result["kind"] == "startup" and result["tokens"] == 64, result
    for launch in ("cold", "warm"):
        assert 0 < result[launch]["first_step_s"] <= result[launch]["exit_s"], result
    assert "launch to first step: cold" in done.stdout


def test_a_failing_startup_launch_is_recorded_with_its_error(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--train=", "--startup=softmax:0:32",
         "--startup_config=configs/quickstart.py:runlocal,nosuchword", f"--out={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (result,) = json.loads((tmp_path / "model_benchmark.json").read_text())
    assert "unknown word 'nosuchword'" in result["cold"]["error"], result


HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->(f32[4]{0}, s32[])}

%fused_add (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %c = f32[] constant(1)
  ROOT %a = f32[4]{0} add(%p, %p)
}

ENTRY %main (x: f32[4]) -> (f32[4]{0}, s32[]) {
  %x = f32[4]{0} parameter(0)
  %c = s32[] constant(3)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  %g = (f32[4]{0}, s8[16]{0}) custom-call(%f), custom_call_target="__cublas$gemm"
  %e = f32[4]{0} get-tuple-element(%g), index=0
  %b = f32[2,2]{1,0} bitcast(%e)
  %y = f32[4]{0} copy(%e)
  ROOT %t = (f32[4]{0}, s32[]) tuple(%y, %c)
}
"""


def test_kernel_launches_counts_the_entry_computations_device_work():
    spec = importlib.util.spec_from_file_location("model_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # the fusion, the library call and the copy; not the fused computation's own add
    assert module.kernel_launches(HLO) == 3


def test_bad_case_specs_fail_before_any_run(tmp_path):
    for flag, spec in (("--decode", "conformal:2:64:0"), ("--forward", "conformal:2:64:2"),
                       ("--train", "conformal:two:64"), ("--startup", "softmax:0")):
        done = subprocess.run([sys.executable, str(SCRIPT), "--train=", f"{flag}={spec}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and f"case '{spec}'" in done.stderr, (flag, done.stderr)
    done = subprocess.run([sys.executable, str(SCRIPT), "--train=", "--decode_impls=xla"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--decode_impls: each of reference, pallas" in done.stderr
