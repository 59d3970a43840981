"""experiments/xla_live_buffers.py: the temporaries alive together, from an XLA dump.

A hand-written dump checks the reading (live ranges through bitcasts, `%name#i` tuple
operands and an output written in place over its operand, counted once); a real CPU
compilation's dump checks it against XLA's own heap: the peak it finds lies between the
largest temporary and the preallocated temp space XLA laid out. Each run is its own process
(the script's absl flags must not join this process's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent
SCRIPT = str(ROOT / "experiments" / "xla_live_buffers.py")
MIB = 2 ** 20

# a (40 MiB) -> k1 writes t{0} over a and t{1} (20 MiB) -> c (10 MiB) from t{1} through a
# bitcast -> k2 reads t#0 and c; the peak is at k1's output: a/t{0} + t{1}, then c joins.
HLO = """HloModule probe, entry_computation_layout={()->f32[]}

%fused (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

ENTRY %main (x: f32[8]) -> f32[] {
  %x = f32[8]{0} parameter(0)
  %a = f32[10485760]{0} fusion(%x), kind=kLoop, calls=%fused
  %t = (f32[10485760]{0}, f32[5242880]{0}) custom-call(%a), custom_call_target="k", \
output_to_operand_aliasing={{0}: (0, {})}, metadata={op_name="jit(f)/k1"}
  %b = f32[5242880]{0} bitcast(%t#1)
  %c = f32[2621440]{0} fusion(%b), kind=kLoop, calls=%fused
  %d = f32[] custom-call(%t#0, %c), custom_call_target="k", metadata={op_name="jit(f)/k2"}
  ROOT %r = f32[] copy(%d)
}
"""
ASSIGNMENT = f"""BufferAssignment:
allocation 0: size 4, parameter 0:
 value: <0 x @0> (size=32,offset=0): f32[8]{{0}}
allocation 1: size {70 * MIB}, preallocated-temp:
 value: <1 a @0> (size={40 * MIB},offset=0): f32[10485760]{{0}}
 value: <2 t{{0}} @0> (size={40 * MIB},offset=0): f32[10485760]{{0}}
 value: <3 t{{1}} @0> (size={20 * MIB},offset={40 * MIB}): f32[5242880]{{0}}
 value: <4 c @0> (size={10 * MIB},offset={60 * MIB}): f32[2621440]{{0}}
 value: <5 d @0> (size=4,offset=0): f32[]
"""


def run(*args) -> str:
    done = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_live_ranges_follow_aliases_and_count_an_in_place_output_once(tmp_path):
    (tmp_path / "m.after_optimizations.txt").write_text(HLO)
    (tmp_path / "m.after_optimizations-buffer-assignment.txt").write_text(ASSIGNMENT)
    out = run(f"--dump={tmp_path}", "--min_mib=1")
    calls = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+(\S+)$", out, re.M)
    # k1: a (= t{0}) and t{1}; k2: a, t{1} (alive up to c) is not, c is
    assert calls == [("2", "60.0", "jit(f)/k1"), ("5", "50.0", "jit(f)/k2")]
    assert "peak 70.0 MiB at position 4: %c = " in out  # a, t{1} (read by c) and c
    assert re.search(r"40\.0 MiB \[   1,    5\] f32\[10485760\]\{0\}  a t\{0\}", out)
    assert re.search(r"20\.0 MiB \[   2,    4\] f32\[5242880\]\{0\}  t\{1\}", out)
    # --at lists another moment's buffers: at k2 (position 5) a and c, t{1} dead
    at_k2 = run(f"--dump={tmp_path}", "--min_mib=1", "--at=5").split("peak ")[0]
    assert "live 50.0 MiB at position 5: %d = " in at_k2
    assert re.findall(r"MiB \[\s*\d+,\s*\d+\] \S+  (.+)$", at_k2, re.M) == ["a t{0}", "c"]
    # --top_calls=1: the custom call with the most live MiB (k1, 60) is listed too
    top = run(f"--dump={tmp_path}", "--min_mib=1", "--top_calls=1").split("peak ")[0]
    assert "live 60.0 MiB at position 2: %t = " in top and "position 5" not in top
    assert re.findall(r"MiB \[\s*\d+,\s*\d+\] \S+  (.+)$", top, re.M) == ["a t{0}", "t{1}"]


def test_a_cpu_compilation_fits_its_own_heap(tmp_path):
    program = ("import jax, jax.numpy as jnp\n"
               "def probe(x):\n"
               "    a = jnp.sin(x) @ x\n"
               "    return (jnp.cos(a) @ a + a).sum()\n"
               "jax.jit(jax.grad(probe)).lower(jnp.ones((512, 512))).compile()\n")
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path} "
                                      "--xla_dump_hlo_module_re=.*probe.*",
           "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", program], env=env, check=True, cwd=ROOT)
    out = run(f"--dump={tmp_path}", "--min_mib=0.5")
    peak = float(re.search(r"^peak ([\d.]+) MiB", out, re.M).group(1))
    (assignment,) = tmp_path.glob("*after_optimizations-buffer-assignment.txt")
    text = assignment.read_text()
    heap = int(re.search(r"allocation \d+: size (\d+), preallocated-temp", text).group(1))
    largest = max(int(s) for s in re.findall(r"size=(\d+),offset", text.split(
        "preallocated-temp")[1].split("\nallocation ")[0]))
    assert largest / MIB <= peak <= heap / MIB, (largest / MIB, peak, heap / MIB)


def test_the_dump_directory_is_required():
    done = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, cwd=ROOT,
                          check=False)
    assert done.returncode != 0 and "--dump is required" in done.stderr
