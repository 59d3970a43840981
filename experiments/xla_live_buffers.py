"""Which temporaries of a compiled XLA module are alive together, read from its dump.

  XLA_FLAGS="--xla_dump_to=/tmp/xla --xla_dump_hlo_module_re=.*fwd_bwd.*" PYTHONPATH=. \
      python3 experiments/benchmark.py --case=mosaic_gpu:chunked,65536,8 --reps=3
  python3 experiments/xla_live_buffers.py --dump=/tmp/xla --min_mib=8

XLA's memory-usage report lists the largest buffers of the preallocated temporary space and
where the heap put them, not which of them are alive at the same time. This reads the entry
computation's schedule (`*after_optimizations.txt`: its instructions in execution order) and
the buffer assignment (`*buffer-assignment.txt`: the temporaries' values and sizes), takes a
value live from the instruction that defines it to its last use, following its aliases
(bitcasts, get-tuple-elements, `%name#i` tuple operands, and outputs written in place over
an operand, `output_to_operand_aliasing`, which are one buffer), and prints the live
megabytes at each custom call (the kernels) and the buffers alive at the peak (and at the
schedule positions --at names, and at the --top_calls custom calls with the most live
megabytes). Values under
--min_mib are left out; the heap XLA lays out can exceed the peak printed here by its
fragmentation.
"""

import glob
import re
import sys
from pathlib import Path
from typing import NamedTuple

from absl import app, flags

_DUMP = flags.DEFINE_string("dump", None, "the --xla_dump_to directory (one module in it)")
_MIN_MIB = flags.DEFINE_float("min_mib", 8.0, "leave out values smaller than this")
_AT = flags.DEFINE_list("at", [], "schedule positions whose live buffers to list too (the "
                        "peak's always are)")
_TOP_CALLS = flags.DEFINE_integer("top_calls", 0, "also list the live buffers at this many "
                                  "custom calls, those with the most live MiB")

INSTRUCTION = re.compile(r"(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)$")
OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")
VALUE = re.compile(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @0> \(size=(\d+),offset=\d+\): (\S+)")
ALIASING = re.compile(r"\{([\d,]*)\}: \((\d+), \{[\d,]*\}\)")


class Buffer(NamedTuple):
    """A temporary buffer: its values (name{index}), size in MiB, shape of the largest value,
    first and last position in the schedule."""

    values: tuple
    mib: float
    shape: str
    start: int
    end: int


def entry_schedule(hlo: str) -> list[str]:
    """The entry computation's instructions, in execution order."""
    body = hlo[hlo.index("\nENTRY"):]
    body = body[body.index("{\n") + 2:body.index("\n}")]
    return [line.strip() for line in body.split("\n") if line.strip()]


def temporaries(assignment: str, min_mib: float) -> dict[tuple[str, str], tuple[float, str]]:
    """{(instruction, '{index}' or ''): (MiB, shape)} of the preallocated temporary space."""
    section = assignment[assignment.index("preallocated-temp"):]
    section = section.split("\nallocation ")[0]
    values = {}
    for name, index, size, shape in VALUE.findall(section):
        if int(size) >= min_mib * 2 ** 20:
            values[(name, index)] = (int(size) / 2 ** 20, shape)
    return values


def live_buffers(schedule: list[str], values) -> tuple[list[Buffer], list[tuple[int, str]]]:
    """The buffers of `values` with their live ranges, and the custom calls (position, op
    name) of the schedule."""
    parent: dict = {}

    def find(v):
        while parent.get(v, v) != v:
            v = parent[v]
        return v

    def union(a, b):
        parent[find(a)] = find(b)

    defined, used, calls = {}, {}, []
    for position, line in enumerate(schedule):
        match = INSTRUCTION.match(line)
        if not match:
            continue
        name, opcode, rest = match.groups()
        head = rest.split("), ")[0]
        operands = [(n, f"{{{i}}}" if i else "") for n, i in OPERAND.findall(head)]
        defined.setdefault((name, ""), position)
        if opcode in ("bitcast", "get-tuple-element") and operands:
            index = re.search(r"index=(\d+)", line) if opcode == "get-tuple-element" else None
            source = (operands[0][0], f"{{{index.group(1)}}}") if index else operands[0]
            union((name, ""), source)
        if "output_to_operand_aliasing=" in line:
            aliasing = line.split("output_to_operand_aliasing=")[1]
            for out_index, operand in ALIASING.findall(aliasing.split("}}")[0] + "}"):
                out = (name, f"{{{out_index}}}" if out_index else "")
                union(out, operands[int(operand)])
        for operand in operands:
            used.setdefault(operand, []).append(position)
            if not operand[1]:  # a whole tuple: every element of it
                used.setdefault((operand[0], None), []).append(position)
        if opcode == "custom-call":
            op_name = re.search(r'op_name="([^"]*)"', line)
            calls.append((position, op_name.group(1) if op_name else name))
    groups: dict = {}
    for value in list(defined) + [v for v in used if v[1] is not None]:
        groups.setdefault(find(value), set()).add(value)
    buffers = []
    for members in groups.values():
        sized = [values[v] for v in members if v in values]
        if not sized:
            continue
        start = min(defined.get((v[0], ""), len(schedule)) for v in members)
        ends = [p for v in members for p in used.get(v, []) + used.get((v[0], None), [])]
        mib, shape = max(sized)
        buffers.append(Buffer(tuple(sorted(a + b for a, b in members if (a, b) in values)),
                              mib, shape, start, max([start, *ends])))
    return buffers, calls


def live_at(buffers: list[Buffer], position: int) -> list[Buffer]:
    return [b for b in buffers if b.start <= position <= b.end]


def report(dump: str, min_mib: float, at: tuple[int, ...] = (), top_calls: int = 0) -> str:
    (hlo,) = glob.glob(str(Path(dump) / "*after_optimizations.txt"))
    (assignment,) = glob.glob(str(Path(dump) / "*after_optimizations-buffer-assignment.txt"))
    schedule = entry_schedule(Path(hlo).read_text())
    buffers, calls = live_buffers(schedule, temporaries(Path(assignment).read_text(), min_mib))
    total = lambda p: sum(b.mib for b in live_at(buffers, p))  # noqa: E731
    peak = max(range(len(schedule)), key=total)
    busiest = sorted((p for p, _ in calls), key=total, reverse=True)[:top_calls]
    at = tuple(dict.fromkeys(p for p in (*at, *sorted(busiest)) if p != peak))
    lines = [f"live MiB of the temporaries >= {min_mib:g} MiB at each custom call:"]
    lines += [f"{p:5d} {total(p):8.1f}  {name}" for p, name in calls]
    for position in (*at, peak):
        title = "peak" if position == peak else "live"
        lines.append(f"{title} {total(position):.1f} MiB at position {position}: "
                     f"{schedule[position][:100]}")
        lines += [f"  {b.mib:7.1f} MiB [{b.start:4d}, {b.end:4d}] {b.shape}  "
                  f"{' '.join(b.values)}"
                  for b in sorted(live_at(buffers, position), key=lambda b: -b.mib)]
    return "\n".join(lines)


def main(argv):
    del argv
    if not _DUMP.value:
        sys.exit("--dump is required: the --xla_dump_to directory")
    print(report(_DUMP.value, _MIN_MIB.value, tuple(int(p) for p in _AT.value),
                 _TOP_CALLS.value))


if __name__ == "__main__":
    app.run(main)
