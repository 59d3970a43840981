"""How the state kernels' rings walk a chunk's state, and the layout a state may be stored
in. state_to_rows takes BLOCKS_PER_STEP blocks S_i [D, E] a step over the square layout,
or over the upper blocks of the symmetric state only (`upper=True`): each S_i from row
j >= 16 (i // 16) on, in static segments of steps whose blocks share their shapes
(`upper_segments`), a step's blocks placed in its ring tiles (`UpperSegment.place`) and
split into the pieces a product takes (`upper_pieces`). The upper layout
(`upper_shapes`) stores only those rows, one array per 16 rows i; a whole block S_j comes
back from it in `whole_block_pieces`. Plain Python: the kernels, their memory warpgroups'
fills and the tests read the same walks."""

from __future__ import annotations

from typing import NamedTuple

BLOCKS_PER_STEP = 2  # state_to_rows: blocks S_i per ring slot
BLOCK = 16  # the symmetric state's blocks of (i, j) that state_to_rows' `upper` reads


def upper_pieces(lo: int, d: int) -> list[tuple[int, int, int]]:
    """(start, stop, weight) per piece of the rows j that y = phi(u) S reads of the blocks
    S_i, i in [lo, lo + BLOCK), when S is symmetric in (i, j): the diagonal block (j in
    [lo, lo + BLOCK)) once, the blocks right of it twice (each stands for its mirror (j, i)
    too), the blocks left of it not at all (their mirrors stand for them). Products of
    K = 16 and d - lo - 16: 62.5 % of the square layout's at d = 64, and of its bytes."""
    pieces = [(lo, lo + BLOCK, 1)]
    return pieces + [(lo + BLOCK, d, 2)] if lo + BLOCK < d else pieces


class UpperSegment(NamedTuple):
    """The ring steps of `state_to_rows(upper=True)` over the blocks S_i of 16 rows i, i in
    [lo, lo + BLOCK): each S_i contributes its rows j >= lo, per_tile of them to a ring
    tile [D, E] (stacked), BLOCKS_PER_STEP tiles a step, from ring step `first` on."""

    lo: int
    per_tile: int
    first: int
    steps: int

    @property
    def blocks(self) -> int:  # blocks S_i a step
        return BLOCKS_PER_STEP * self.per_tile

    def place(self, step, u: int, d: int):
        """(i, tile, first row) of a step's u-th block S_i[lo:] (its D - lo rows j): the
        kernel's fill and its products both find a block here."""
        rows_j = d - self.lo
        return (self.lo + (step - self.first) * self.blocks + u, u // self.per_tile,
                (u % self.per_tile) * rows_j)


def upper_segments(d: int, packed: bool) -> list[UpperSegment]:
    """The static segments of `upper`'s ring walk: one per 16 rows i, with one block S_i a
    tile, or `packed` as many as fit (D // (D - lo): 1, 1, 2, 4 at D = 64), so every step
    carries at least half a square step's products: 22 steps a chunk in place of 32."""
    segments, first = [], 0
    for lo in range(0, d, BLOCK):
        per_tile = d // (d - lo) if packed else 1
        steps = BLOCK // (BLOCKS_PER_STEP * per_tile)
        segments.append(UpperSegment(lo, per_tile, first, steps))
        first += steps
    return segments


def upper_rows(group: int, d: int) -> int:
    """Rows j an S_i of the 16-row group `group` (i // BLOCK) keeps in the upper layout."""
    return d - BLOCK * group


def upper_shapes(lead: tuple[int, ...], d: int, e: int) -> list[tuple[int, ...]]:
    """The upper layout of a symmetric state [*lead, D^2, E]: one array per 16 rows i,
    [*lead, BLOCK, D - 16 b, E] for b = i // BLOCK, holding S[(i, j)] for j >= 16 b (62.5 %
    of the square bytes at D = 64). Every other entry is the mirror of a held one, which a
    reader of whole blocks S_j takes from array b' < j // BLOCK at [..., :, j - 16 b', :]:
    a box of BLOCK rows (`state_references.square_of_upper`)."""
    return [(*lead, BLOCK, upper_rows(group, d), e) for group in range(d // BLOCK)]


class BlockPiece(NamedTuple):
    """Rows [first, first + rows) of a whole block S_j read from the upper layout: from
    array `group` at index j - 16 group (its held rows i >= 16 (j // 16): `mirror`
    False), or as the mirrors S_i[j] of the rows i of a lower group, the box [:, j - 16
    group] of that group's array (`mirror` True)."""

    group: int
    mirror: bool
    first: int
    rows: int


def whole_block_pieces(j: int, d: int) -> list[BlockPiece]:
    """The pieces that fill a whole block S_j [D, E] from the upper layout: its held rows,
    then one box of BLOCK mirrored rows per group below j's."""
    group = j // BLOCK
    return [BlockPiece(group, False, BLOCK * group, upper_rows(group, d))] + [
        BlockPiece(below, True, BLOCK * below, BLOCK) for below in range(group)]
