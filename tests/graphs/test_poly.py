"""Exact polynomials and their fitting from probe values."""

from __future__ import annotations

from fractions import Fraction

import pytest

from graphs.poly import PeakPoly, Poly, ProbeValues, fit_probe_values


def _measure(f, b0=2, s0=32):
    one, half = Fraction(1), Fraction(1, 2)
    values = [f(b0, s0, one), f(b0, 2 * s0, one), f(b0, 3 * s0, one), f(2 * b0, s0, one), f(b0, s0, half)]
    return ProbeValues(*(int(v) for v in values))


@pytest.mark.parametrize("formula", [
    lambda b, s, t: 4096 * b * s,  # an activation
    lambda b, s, t: 8 * b * (s + 1),  # padded labels
    lambda b, s, t: 2 * b * s * s * 8 / t,  # attention scores on a TP rank
    lambda b, s, t: 256 * s + 128,  # rotary tables
    lambda b, s, t: 1000 + 500 / t,  # a partly sharded weight-sized buffer
])
def test_fit_recovers_polynomial_exactly_at_unseen_points(formula):
    poly = fit_probe_values(_measure(formula), b0=2, s0=32)
    for b, s, t in [(1, 7, 1), (5, 4097, 8), (3, 80, 2)]:
        assert poly.exact(b, s, t) == formula(b, s, Fraction(t))


def test_fit_rejects_quantities_not_linear_in_batch():
    with pytest.raises(ValueError, match="micro-batch"):
        fit_probe_values(_measure(lambda b, s, t: b * b * s), b0=2, s0=32)


def test_peak_poly_keeps_only_undominated_candidates_and_takes_the_max():
    small = Poly.of({(1, 1, 0): 10})
    big = Poly.of({(1, 1, 0): 20})
    quadratic = Poly.of({(1, 2, 0): 1})
    peak = PeakPoly.of([small, big, quadratic])
    assert small not in peak.candidates and big in peak.candidates
    assert peak(1, 10) == 200 and peak(1, 100) == 10000


def test_poly_json_round_trip_is_exact():
    poly = Poly.of({(1, 1, 1): Fraction(7, 3), (0, 0, 0): 5})
    assert Poly.from_json(poly.to_json()) == poly
