"""Sequence packing versus padding, from the dataset's length histogram: how many of the tokens a step computes
are real ones, and how long the longest micro-batch can be (memory must be planned on that one, not on the mean).

Padding follows the Hugging Face collators: `padding="longest"` (DataCollatorWithPadding's default) pads each
micro-batch to its longest sequence, `padding="max_length"` to the sequence length. Packing follows TRL's
`SFTConfig(packing=True)`: `"wrapped"` concatenates the sequences and cuts rows of exactly the sequence length
(sequences split across rows), `"bfd"` places whole sequences (truncated to the sequence length) into rows by
best-fit decreasing, leaving the unfilled ends of rows as padding. Sequences of one micro-batch are drawn
independently from the histogram (a shuffled dataset), so the padded length of a micro-batch of b sequences is the
maximum of b draws: E[max] = sum over lengths l of l * (F(l)^b - F(l-)^b), with F the cumulative distribution.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from graphs import FitplanError
from graphs.files import UnreadableFile, parse_json, read_text

Padding = Literal["longest", "max_length"]
Packing = Literal["wrapped", "bfd"]
MAX_SEQUENCES = 5_000_000
"""Best-fit decreasing places sequences one by one; beyond this a histogram should be subsampled."""


@dataclass(frozen=True, slots=True)
class Lengths:
    """A histogram of sequence lengths in tokens: (length, number of sequences), ascending by length."""

    counts: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.counts:
            raise FitplanError("The dataset length histogram is empty.", "Give at least one sequence length.")
        for length, count in self.counts:
            if not (isinstance(length, int) and isinstance(count, int)) or length < 1 or count < 1:
                raise FitplanError(f"Bad histogram entry: length {length!r} with count {count!r}.",
                                   "Lengths and counts are positive whole numbers.")
        if [length for length, _ in self.counts] != sorted({length for length, _ in self.counts}):
            raise ValueError("counts must be ascending by length, each length once")

    @classmethod
    def of(cls, lengths: dict[int, int] | list[int]) -> Lengths:
        """From {length: count} or a list of lengths (one per sequence)."""
        counter = Counter(lengths) if isinstance(lengths, list) else Counter(dict(lengths))
        return cls(tuple(sorted(counter.items())))

    @property
    def sequences(self) -> int:
        return sum(count for _, count in self.counts)

    @property
    def tokens(self) -> int:
        return sum(length * count for length, count in self.counts)

    @property
    def longest(self) -> int:
        return self.counts[-1][0]

    def mean(self) -> float:
        return self.tokens / self.sequences

    def truncated(self, seq_len: int) -> Lengths:
        """The lengths the model sees when sequences longer than `seq_len` are cut to it (the collators' and TRL's
        `max_length` truncation)."""
        counter: Counter[int] = Counter()
        for length, count in self.counts:
            counter[min(length, seq_len)] += count
        return Lengths(tuple(sorted(counter.items())))


@dataclass(frozen=True, slots=True)
class Batching:
    """What a batching strategy computes per row (a sequence slot of a micro-batch)."""

    strategy: str
    useful_fraction: float
    """Real tokens over computed tokens (1.0: no padding)."""
    planned_seq_len: int
    """The longest row a micro-batch can hold: memory is planned on it."""
    mean_row_tokens: float
    """Computed tokens per row on average (the step's time follows these)."""
    sequences_per_row: float
    """Dataset sequences per row (more than 1 when packing)."""

    def describe(self) -> str:
        return (f"{self.strategy}: {self.useful_fraction:.1%} of computed tokens are real, rows of "
                f"{self.mean_row_tokens:,.0f} tokens on average, memory planned at {self.planned_seq_len:,}, "
                f"{self.sequences_per_row:.2f} sequences per row")


def expected_longest(lengths: Lengths, micro_batch: int) -> float:
    """E[max length of `micro_batch` independent draws from `lengths`] (exact)."""
    total, below, expected = lengths.sequences, 0, 0.0
    for length, count in lengths.counts:
        expected += length * (((below + count) / total) ** micro_batch - (below / total) ** micro_batch)
        below += count
    return expected


def padded(lengths: Lengths, seq_len: int, micro_batch: int, to: Padding = "longest") -> Batching:
    """Each micro-batch padded to its longest sequence, or every row to `seq_len`."""
    seen = lengths.truncated(seq_len)
    row = expected_longest(seen, micro_batch) if to == "longest" else float(seq_len)
    planned = min(seen.longest, seq_len) if to == "longest" else seq_len
    return Batching(f"padding to the {'longest in the micro-batch' if to == 'longest' else 'sequence length'}",
                    seen.mean() / row, planned, row, 1.0)


def packed(lengths: Lengths, seq_len: int, strategy: Packing = "wrapped") -> Batching:
    """Rows of `seq_len` tokens filled with whole (best-fit decreasing) or split (wrapped) sequences."""
    if strategy == "wrapped":
        return Batching("packing (wrapped: sequences concatenated and cut into rows)", 1.0, seq_len,
                        float(seq_len), seq_len / lengths.mean())
    seen = lengths.truncated(seq_len)
    rows = best_fit_decreasing_rows(seen, seq_len)
    return Batching("packing (best-fit decreasing: whole sequences per row)", seen.tokens / (rows * seq_len),
                    seq_len, float(seq_len), seen.sequences / rows)


def best_fit_decreasing_rows(lengths: Lengths, capacity: int) -> int:
    """Rows best-fit decreasing fills: longest sequence first, each into the row with the least room that still
    holds it, a new row when none does."""
    if lengths.longest > capacity:
        raise ValueError(f"a sequence of {lengths.longest} tokens exceeds the row capacity {capacity}")
    if lengths.sequences > MAX_SEQUENCES:
        raise FitplanError(f"The length histogram holds {lengths.sequences:,} sequences; packing is simulated "
                           f"sequence by sequence up to {MAX_SEQUENCES:,}.",
                           "Subsample the dataset's lengths (the fractions are what matter).")
    room: list[int] = []  # free tokens of each open row, ascending
    for length, count in reversed(lengths.counts):
        for _ in range(count):
            at = bisect.bisect_left(room, length)
            if at == len(room):
                bisect.insort(room, capacity - length)
            else:
                left = room.pop(at) - length
                bisect.insort(room, left)
    return len(room)


def read_lengths(path: Path) -> Lengths:
    """`--dataset-lengths`: a JSON object {"length": count, ...}, a JSON list of lengths, or JSON Lines of lengths
    (a number, or an object with "length" or "num_tokens", per line)."""
    text = read_text(path, what="dataset length file")
    where = f"dataset length file {path}"
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        data: object = parse_json(text, where=where)
    except UnreadableFile:
        if len(lines) < 2:
            raise
        data = [parse_json(line, where=f"{where}, line {number}") for number, line in enumerate(lines, 1)]
    try:
        if isinstance(data, dict) and "length" not in data and "num_tokens" not in data:
            return Lengths.of({int(length): _count(count) for length, count in data.items()})
        return Lengths.of([_length_of(item) for item in (data if isinstance(data, list) else [data])])
    except ValueError as error:
        raise FitplanError(f"{where} is not a length histogram: {error}.",
                           'Give {"512": 1200, "2048": 300} (length: sequences), a list of lengths, or JSON Lines '
                           "with one length (or {\"length\": n}) per line.") from None


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"count {value!r} is not a whole number")
    return value


def _length_of(item: object) -> int:
    value = item.get("length", item.get("num_tokens")) if isinstance(item, dict) else item
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{item!r} is not a length")
    return value
