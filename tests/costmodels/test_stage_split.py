"""Pipeline stage splits against brute force over every contiguous split of small random models."""

from __future__ import annotations

import random

import pytest

from costmodels.stage_split import balanced_split, megatron_split, megatron_splits, rank_balanced_split, stage_costs


def compositions(n: int, k: int, least: int):
    """Every way to write n as k ordered parts of at least `least`."""
    if k == 1:
        if n >= least:
            yield (n,)
        return
    for first in range(least, n - least * (k - 1) + 1):
        for rest in compositions(n - first, k - 1, least):
            yield (first, *rest)


def random_instance(rng: random.Random, integer: bool):
    n, k = rng.randint(1, 10), rng.randint(1, 5)
    costs = [rng.choice([0, 1, 2, 3, 5, 8]) if integer else rng.uniform(0.0, 3.0) for _ in range(n)]
    return costs, k, rng.choice([0.0, 0.5, 4.0, 10.0]), rng.choice([0.0, 2.0, 7.0, 20.0])


@pytest.mark.parametrize("allow_empty", [False, True])
def test_balanced_split_minimises_the_costliest_stage_like_brute_force(allow_empty):
    rng = random.Random(3)
    checked = 0
    for trial in range(300):
        costs, k, first, last = random_instance(rng, integer=trial % 2 == 0)
        if not allow_empty and len(costs) < k:
            continue
        best = min(max(stage_costs(c, costs, first_extra=first, last_extra=last))
                   for c in compositions(len(costs), k, 0 if allow_empty else 1))
        split = balanced_split(costs, k, first_extra=first, last_extra=last, allow_empty=allow_empty)
        assert len(split) == k and sum(split) == len(costs)
        assert allow_empty or min(split) >= 1
        # Tolerance: the search and stage_costs add the same floats in a different order.
        assert max(stage_costs(split, costs, first_extra=first, last_extra=last)) == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 200


def test_megatron_split_is_best_with_even_middle_stages_like_brute_force():
    rng = random.Random(5)
    for trial in range(200):
        costs, k, first, last = random_instance(rng, integer=trial % 2 == 0)
        if len(costs) < k:
            continue
        allowed = [c for c in compositions(len(costs), k, 1) if len(set(c[1:-1])) <= 1]
        best = min(max(stage_costs(c, costs, first_extra=first, last_extra=last)) for c in allowed)
        split = megatron_split(costs, k, first_extra=first, last_extra=last)
        assert split in allowed
        assert max(stage_costs(split, costs, first_extra=first, last_extra=last)) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("layers,stages", [(1, 1), (7, 1), (2, 2), (9, 2), (3, 3), (10, 3), (13, 4), (16, 5), (12, 12)])
def test_megatron_splits_are_every_split_with_even_middle_stages(layers, stages):
    expected = [c for c in compositions(layers, stages, 1) if len(set(c[1:-1])) <= 1]
    assert sorted(megatron_splits(layers, stages)) == sorted(expected)
    assert len(set(megatron_splits(layers, stages))) == len(expected)


def test_heavy_embedding_and_head_take_layers_from_the_end_stages():
    # 32 equal layers over 4 stages; the embedding costs 2 layers and the head and loss 5.
    assert balanced_split([1.0] * 32, 4, first_extra=2.0, last_extra=5.0) == (7, 10, 10, 5)
    assert megatron_split([1.0] * 32, 4, first_extra=2.0, last_extra=5.0) == (7, 10, 10, 5)


def test_ties_keep_the_first_stage_lightest():
    assert balanced_split([1.0] * 10, 4) == (1, 3, 3, 3)


def test_an_lm_head_heavier_than_a_stage_gets_an_empty_last_stage_only_when_allowed():
    assert balanced_split([1.0] * 6, 3, last_extra=4.0, allow_empty=True) == (2, 4, 0)
    assert balanced_split([1.0] * 6, 3, last_extra=4.0) == (1, 4, 1)


def test_bad_splits_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_split([1.0] * 3, 4)
    with pytest.raises(ValueError, match="non-negative"):
        balanced_split([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="sum to"):
        stage_costs((1, 1), [1.0] * 3)


def rank_costs(split, cost: float, ranks, first: float, last: float) -> list[float]:
    """Each rank's cost: its stages' layers and the end stages' extras."""
    stages = stage_costs(split, [cost] * sum(split), first_extra=first, last_extra=last)
    return [sum(c for c, r in zip(stages, ranks, strict=True) if r == rank) for rank in sorted(set(ranks))]


@pytest.mark.parametrize("shape", ["looped", "v"])
def test_rank_balanced_split_minimises_the_busiest_rank_then_its_costliest_stage_like_brute_force(shape):
    """Every split of n layers into pp x v stages (each stage on rank k mod pp, or a V for zbv), by the busiest
    rank's cost, then the costliest stage among the splits that reach it."""
    rng = random.Random(11)
    checked = 0
    for _ in range(120):
        pp, v = rng.choice([2, 3]), 2 if shape == "v" else rng.choice([2, 3])
        n = rng.randint(pp * v, pp * v + 6)
        cost, first, last = rng.choice([1.0, 2.5]), rng.choice([0.0, 0.3, 1.7]), rng.choice([0.0, 0.9, 3.2, 6.0])
        ranks = tuple(range(pp)) + tuple(reversed(range(pp))) if shape == "v" else \
            tuple(k % pp for k in range(pp * v))
        every = list(compositions(n, pp * v, 1))
        busiest = min(max(rank_costs(c, cost, ranks, first, last)) for c in every)
        best = [c for c in every if max(rank_costs(c, cost, ranks, first, last)) == pytest.approx(busiest)]
        costliest = min(max(stage_costs(c, [cost] * n, first_extra=first, last_extra=last)) for c in best)
        split = rank_balanced_split(cost, n, ranks, first_extra=first, last_extra=last)
        assert sum(split) == n and min(split) >= 1
        assert max(rank_costs(split, cost, ranks, first, last)) == pytest.approx(busiest)
        assert max(stage_costs(split, [cost] * n, first_extra=first, last_extra=last)) == pytest.approx(costliest)
        checked += 1
    assert checked == 120
