"""Packing and padding from a length histogram (issue 14), against brute force: the expected padded length of a
micro-batch against every ordered draw of its sequences, best-fit decreasing against a plain list implementation
of the rule, and the collators' padding against transformers' own DataCollatorWithPadding."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from costmodels.packing import Lengths, best_fit_decreasing_rows, expected_longest, packed, padded, read_lengths
from graphs import FitplanError

HISTOGRAMS = [{7: 3}, {1: 1, 5: 2}, {3: 4, 9: 1, 12: 2}, {2: 1, 4: 1, 8: 1, 16: 1}]


@pytest.mark.parametrize("histogram", HISTOGRAMS)
@pytest.mark.parametrize("micro_batch", [1, 2, 3])
def test_expected_longest_equals_every_draw_enumerated(histogram, micro_batch):
    population = [length for length, count in histogram.items() for _ in range(count)]
    draws = list(itertools.product(population, repeat=micro_batch))  # independent draws, with replacement
    exact = Fraction(sum(max(draw) for draw in draws), len(draws))
    assert expected_longest(Lengths.of(histogram), micro_batch) == pytest.approx(float(exact), rel=1e-12)


def naive_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    for length in sorted(lengths, reverse=True):
        fitting = [row for row in rows if capacity - sum(row) >= length]
        if fitting:
            min(fitting, key=lambda row: capacity - sum(row)).append(length)
        else:
            rows.append([length])
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_decreasing_fills_as_many_rows_as_the_rule_by_hand(seed):
    rng = random.Random(seed)
    capacity = rng.choice([16, 64, 100])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 120))]
    rows = naive_best_fit_decreasing(lengths, capacity)
    assert all(sum(row) <= capacity for row in rows)
    assert sorted(length for row in rows for length in row) == sorted(lengths)
    assert best_fit_decreasing_rows(Lengths.of(lengths), capacity) == len(rows)


def test_packing_fractions():
    lengths = Lengths.of({300: 10, 700: 10, 2048: 1})
    wrapped = packed(lengths, 1024, "wrapped")
    assert (wrapped.useful_fraction, wrapped.planned_seq_len) == (1.0, 1024)
    assert wrapped.sequences_per_row == pytest.approx(1024 / lengths.mean())
    bfd = packed(lengths, 1024, "bfd")  # 300+700 pairs fill ten rows of 1000; the long one truncated to 1024
    assert bfd.useful_fraction == pytest.approx((10 * 1000 + 1024) / (11 * 1024))
    assert bfd.sequences_per_row == pytest.approx(21 / 11)


def test_padding_plans_memory_on_the_longest_micro_batch_not_the_mean():
    lengths = Lengths.of({100: 99, 4000: 1})
    longest = padded(lengths, 2048, micro_batch=4)
    assert longest.planned_seq_len == 2048  # one sequence is truncated to 2048: a micro-batch may hold it
    assert longest.mean_row_tokens == pytest.approx(expected_longest(lengths.truncated(2048), 4))
    assert longest.useful_fraction == pytest.approx(lengths.truncated(2048).mean() / longest.mean_row_tokens)
    fixed = padded(lengths, 2048, micro_batch=4, to="max_length")
    assert fixed.useful_fraction == pytest.approx(lengths.truncated(2048).mean() / 2048)
    assert padded(Lengths.of({512: 5}), 2048, 8).planned_seq_len == 512


def test_padding_to_the_longest_matches_transformers_collator():
    """DataCollatorWithPadding pads a batch to its longest sequence: the computed tokens of each batch are
    micro_batch x the longest, the mean of which `expected_longest` gives over all batches of a histogram."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[PAD]": 0, "a": 1},
                                                                                    unk_token="[PAD]")),
                                        pad_token="[PAD]")
    collate = DataCollatorWithPadding(tokenizer, padding="longest")
    population = [3, 3, 5, 9]
    batches = list(itertools.product(population, repeat=2))
    computed = [collate([{"input_ids": [1] * n} for n in batch])["input_ids"].numel() for batch in batches]
    assert sum(computed) / len(computed) == pytest.approx(2 * expected_longest(Lengths.of(population), 2))


@pytest.mark.parametrize(("text", "expected"), [
    ('{"512": 3, "1024": 1}', {512: 3, 1024: 1}),
    ("[5, 5, 9]", {5: 2, 9: 1}),
    ("5\n5\n9\n", {5: 2, 9: 1}),
    ('{"length": 5}\n{"num_tokens": 9}\n', {5: 1, 9: 1}),
])
def test_length_files_read(text, expected, tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(text)
    assert read_lengths(path) == Lengths.of(expected)


@pytest.mark.parametrize("text", ['{"a": 3}', '{"512": -1}', "[0, 5]", '["x"]', "[true]", "{", "", "[]",
                                  '{"512": 1.5}'])
def test_bad_length_files_are_refused_with_a_clear_error(text, tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(text)
    with pytest.raises(FitplanError):
        read_lengths(path)
