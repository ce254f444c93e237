"""How a model's decoder layers split into contiguous pipeline stages so that the slowest stage is as fast as
possible; the embedding rides with the first stage and the LM head and loss with the last.

Costs are any non-negative additive per-layer quantity (seconds, FLOPs, bytes); ties keep the first stage light,
since under 1F1B it holds the most micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate


def stage_costs(layers: Sequence[int], layer_costs: Sequence[float], *, first_extra: float = 0.0,
                last_extra: float = 0.0) -> tuple[float, ...]:
    """Cost of each stage when stage k takes the next `layers[k]` layers."""
    if sum(layers) != len(layer_costs) or any(n < 0 for n in layers):
        raise ValueError(f"stage sizes {tuple(layers)} must be non-negative and sum to {len(layer_costs)} layers")
    bounds = [0, *accumulate(layers)]
    prefix = [0.0, *accumulate(layer_costs)]
    costs = [prefix[bounds[k + 1]] - prefix[bounds[k]] for k in range(len(layers))]
    costs[0] += first_extra
    costs[-1] += last_extra
    return tuple(costs)


def balanced_split(layer_costs: Sequence[float], stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0,
                   allow_empty: bool = False) -> tuple[int, ...]:
    """Layers per stage of the contiguous split into `stages` stages that minimises the costliest stage (exact:
    a binary search over every contiguous range's cost, each tried by a greedy fill from the last stage)."""
    _check(layer_costs, stages, first_extra, last_extra, allow_empty)
    prefix = [0.0, *accumulate(layer_costs)]
    n = len(layer_costs)
    # Every value a stage can cost: any range, with or without either extra (empty end stages shift the ranges).
    candidates = sorted({_range_cost(prefix, i, j, first_extra * first + last_extra * last)
                         for i in range(n + 1) for j in range(i, n + 1) for first in (0, 1) for last in (0, 1)})
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if _greedy_from_last(prefix, stages, candidates[middle], first_extra, last_extra, allow_empty) is None:
            low = middle + 1
        else:
            high = middle
    split = _greedy_from_last(prefix, stages, candidates[low], first_extra, last_extra, allow_empty)
    if split is None:  # the largest candidate always fits; reaching here is a bug
        raise RuntimeError("no feasible split at the largest stage cost")
    return split


def _range_cost(prefix: list[float], i: int, j: int, extra: float) -> float:
    """Cost of layers [i, j) plus `extra`, in the same float arithmetic everywhere so that comparisons with the
    candidate limits are exact."""
    return prefix[j] - prefix[i] + extra


def _greedy_from_last(prefix: list[float], stages: int, limit: float, first_extra: float, last_extra: float,
                      allow_empty: bool) -> tuple[int, ...] | None:
    """Fill stages from the last, each with as many layers as fit under `limit` (leaving one per earlier stage
    unless empty stages are allowed); None when the first stage then exceeds `limit`. Taking the most layers
    at each step never hurts the stages before it, so this succeeds whenever any split fits."""
    n = len(prefix) - 1
    least = 0 if allow_empty else 1
    end, sizes = n, []
    for k in range(stages - 1, 0, -1):
        start = end - least
        extra = last_extra if k == stages - 1 else 0.0
        while start - 1 >= k * least and _range_cost(prefix, start - 1, end, extra) <= limit:
            start -= 1
        if _range_cost(prefix, start, end, extra) > limit:
            return None
        sizes.append(end - start)
        end = start
    if _range_cost(prefix, 0, end, first_extra + (last_extra if stages == 1 else 0.0)) > limit or end < least:
        return None
    return (end, *reversed(sizes))


def megatron_split(layer_costs: Sequence[float], stages: int, *, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> tuple[int, ...]:
    """The best split Megatron-core can express: `--decoder-first-pipeline-num-layers` and
    `--decoder-last-pipeline-num-layers` set the two ends and the middle stages share the rest evenly
    (arguments.py requires the remainder to divide by the middle stage count)."""
    _check(layer_costs, stages, first_extra, last_extra, allow_empty=False)
    n = len(layer_costs)
    if stages <= 2:
        return balanced_split(layer_costs, stages, first_extra=first_extra, last_extra=last_extra)
    middle = stages - 2
    prefix = [0.0, *accumulate(layer_costs)]
    best: tuple[float, tuple[int, ...]] | None = None
    for last in range(n - middle, 0, -1):
        last_cost = prefix[n] - prefix[n - last] + last_extra
        if best is not None and last_cost >= best[0]:
            continue
        # the first sizes that leave the middle stages equal: first = n - last (mod middle), from 1 up
        for first in range((n - last) % middle or middle, n - middle - last + 1, middle):
            size = (n - first - last) // middle
            worst = max(prefix[first] + first_extra, last_cost)  # as `stage_costs` sums them
            if best is not None and worst >= best[0]:
                continue
            for k in range(middle):
                start = first + size * k
                worst = max(worst, prefix[start + size] - prefix[start])
            if best is None or worst < best[0]:
                best = worst, (first, *([size] * middle), last)
    if best is None:  # first = last = 1 leaves n - 2 >= middle layers; some split always exists
        raise RuntimeError("no Megatron split found")
    return best[1]


def rank_balanced_split(layer_cost: float, layers: int, ranks: Sequence[int], *, first_extra: float = 0.0,
                        last_extra: float = 0.0) -> tuple[int, ...]:
    """Layers of each stage when the stages of several per rank (stage k on rank `ranks[k]`) take layers of one
    cost: the split whose busiest rank is least busy, and within each rank whose costliest stage is cheapest. Under
    an interleaved schedule a rank runs all its stages for every micro-batch, so its total bounds the steady phase
    (the stages' own sizes only the warm-up); any contiguous split runs (Megatron's pipeline layout, torchtitan's
    module names per part). Exact by water-filling: each layer goes to the rank, then the stage, that costs least
    with it (ties to the later one: earlier ranks and stages hold more micro-batches in flight)."""
    stages = len(ranks)
    if layers < stages or not layer_cost >= 0 or not first_extra >= 0 or not last_extra >= 0:
        raise ValueError(f"{layers} layers of cost {layer_cost} cannot fill {stages} stages of at least one layer")
    extras = [0.0] * stages
    extras[0] += first_extra
    extras[-1] += last_extra
    own = {r: [k for k in range(stages) if ranks[k] == r] for r in sorted(set(ranks))}
    totals = {r: len(ks) for r, ks in own.items()}  # one layer per stage first
    for _ in range(layers - stages):
        cheapest = min(own, key=lambda r: (layer_cost * (totals[r] + 1) + sum(extras[k] for k in own[r]), -r))
        totals[cheapest] += 1
    sizes = [1] * stages
    for r, ks in own.items():
        for _ in range(totals[r] - len(ks)):
            cheapest = min(ks, key=lambda k: (layer_cost * (sizes[k] + 1) + extras[k], -k))
            sizes[cheapest] += 1
    return tuple(sizes)


@lru_cache(maxsize=256)
def megatron_splits(layers: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """Every split Megatron's first/last flags express: each end any size, the middle stages equal, every stage
    at least one layer (every contiguous split when there are at most two stages)."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages!r} stages of at least one layer each")
    if stages == 1:
        return ((layers,),)
    if stages == 2:
        return tuple((first, layers - first) for first in range(1, layers))
    middle = stages - 2
    return tuple((first, *([(layers - first - last) // middle] * middle), last)
                 for first in range(1, layers - middle) for last in range(1, layers - middle - first + 1)
                 if (layers - first - last) % middle == 0)


def _check(layer_costs: Sequence[float], stages: int, first_extra: float, last_extra: float,
           allow_empty: bool) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages={stages!r} must be a positive integer")
    if any(not c >= 0 for c in (*layer_costs, first_extra, last_extra)):
        raise ValueError("layer and stage costs must be non-negative numbers")
    if not allow_empty and len(layer_costs) < stages:
        raise ValueError(f"{len(layer_costs)} layers cannot fill {stages} stages of at least one layer each")
