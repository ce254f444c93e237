"""Exact costs as polynomials in micro-batch `b`, sequence length `s` and tensor-parallel degree `t`.

A lowered layer's bytes and FLOPs are sums of monomials `c * b^i * s^j / t^k`: every tensor's size and every
matmul's work is a product of its dimensions. `Poly` holds such a sum exactly; `PeakPoly` holds the maximum of
several (a layer's transient peak is the largest of its per-op working sets, which may switch with the shape).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

Monomial = tuple[int, int, int]
"""Powers of (b, s, 1/t)."""

_NAMES = ("b", "s", "/t")


def _clean(terms: Mapping[Monomial, Fraction]) -> tuple[tuple[Monomial, Fraction], ...]:
    return tuple(sorted((m, Fraction(c)) for m, c in terms.items() if c != 0))


@dataclass(frozen=True, slots=True)
class Poly:
    """An exact polynomial in b, s and 1/t with rational coefficients."""

    terms: tuple[tuple[Monomial, Fraction], ...] = ()
    _integer: tuple[int, int, tuple[tuple[int, int, int, int], ...]] | None = field(
        default=None, init=False, repr=False, compare=False)
    """(common denominator, top power of 1/t, integer terms), built on first evaluation: the solver evaluates the
    same polynomials at many shapes, and hashing Fractions per call (a shared cache) cost more than the sum."""

    @classmethod
    def of(cls, terms: Mapping[Monomial, int | Fraction]) -> Poly:
        return cls(_clean({m: Fraction(c) for m, c in terms.items()}))

    @classmethod
    def const(cls, c: int | Fraction) -> Poly:
        return cls.of({(0, 0, 0): c})

    def as_dict(self) -> dict[Monomial, Fraction]:
        return dict(self.terms)

    def __add__(self, other: Poly) -> Poly:
        acc = self.as_dict()
        for m, c in other.terms:
            acc[m] = acc.get(m, Fraction(0)) + c
        return Poly(_clean(acc))

    def __sub__(self, other: Poly) -> Poly:
        return self + other.scaled(-1)

    def __neg__(self) -> Poly:
        return self.scaled(-1)

    def scaled(self, factor: int | Fraction) -> Poly:
        return Poly(_clean({m: c * factor for m, c in self.terms}))

    def __bool__(self) -> bool:
        return bool(self.terms)

    def exact(self, b: int, s: int, t: int = 1) -> Fraction:
        """The value at (b, s, t), as an exact fraction."""
        return sum((c * Fraction(b**i * s**j, t**k) for (i, j, k), c in self.terms), Fraction(0))

    def __call__(self, b: int, s: int, t: int = 1) -> int:
        """The value at (b, s, t), rounded up to a whole number (bytes and FLOPs are counted whole)."""
        form = self._integer
        if form is None:
            form = _integer_form(self.terms)
            object.__setattr__(self, "_integer", form)
        scale, top, terms = form
        total = sum(c * b**i * s**j * t**k for i, j, k, c in terms)
        return -(-total // (scale * t**top))

    def without_tp(self) -> Poly:
        """The same quantity when nothing is split by tensor parallelism (t = 1 folded in)."""
        acc: dict[Monomial, Fraction] = {}
        for (i, j, _), c in self.terms:
            acc[(i, j, 0)] = acc.get((i, j, 0), Fraction(0)) + c
        return Poly(_clean(acc))

    def dominated_by(self, other: Poly) -> bool:
        """True when `other - self` has no negative coefficient, so self <= other for all b, s, t >= 0."""
        return all(c >= 0 for _, c in (other - self).terms)

    def to_json(self) -> list[list[int | str]]:
        return [[i, j, k, str(c)] for (i, j, k), c in self.terms]

    @classmethod
    def from_json(cls, data: Iterable[list[int | str]]) -> Poly:
        return cls.of({(int(i), int(j), int(k)): Fraction(str(c)) for i, j, k, c in data})

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for mono, c in self.terms:
            factors = [n if p == 1 else f"{n}^{p}" for n, p in zip(_NAMES, mono, strict=True) if p]
            parts.append("*".join([str(c), *factors]))
        return " + ".join(parts)


ZERO = Poly()


def _integer_form(terms: tuple[tuple[Monomial, Fraction], ...]) -> tuple[int, int, tuple[tuple[int, int, int, int],
                                                                                       ...]]:
    """(common denominator, top power of 1/t, terms as (i, j, top - k, numerator)): `Poly.__call__` evaluates
    sum(numerator * b^i * s^j * t^(top - k)) / (denominator * t^top) in integers, exact and fast."""
    scale = math.lcm(*(c.denominator for _, c in terms)) if terms else 1
    top = max((k for (_, _, k), _ in terms), default=0)
    return scale, top, tuple((i, j, top - k, int(c * scale)) for (i, j, k), c in terms)


@dataclass(frozen=True, slots=True)
class PeakPoly:
    """The maximum of several polynomials: a transient peak whose location may move with the shape."""

    candidates: tuple[Poly, ...] = ()

    @classmethod
    def of(cls, polys: Iterable[Poly]) -> PeakPoly:
        """Keep only candidates that no other candidate dominates coefficient-wise."""
        unique: list[Poly] = []
        for p in polys:
            if p not in unique:
                unique.append(p)
        kept = [p for i, p in enumerate(unique)
                if not any(j != i and p.dominated_by(q) for j, q in enumerate(unique))]
        return cls(tuple(sorted(kept, key=lambda p: p.terms)))

    def __call__(self, b: int, s: int, t: int = 1) -> int:
        return max((p(b, s, t) for p in self.candidates), default=0)

    def shifted(self, offset: Poly) -> PeakPoly:
        return PeakPoly.of(p + offset for p in self.candidates)

    def to_json(self) -> list[list[list[int | str]]]:
        return [p.to_json() for p in self.candidates]

    @classmethod
    def from_json(cls, data: Iterable[Iterable[list[int | str]]]) -> PeakPoly:
        return cls(tuple(Poly.from_json(p) for p in data))


@dataclass(frozen=True, slots=True)
class ProbeValues:
    """One measured quantity at the five probes: (b0, s0), (b0, 2*s0), (b0, 3*s0), (2*b0, s0), and (b0, s0)
    on the model widened to twice the heads and FFN width (one TP rank at t = 1/2)."""

    base: int
    longer: int
    longest: int
    wider: int
    widened: int


def fit_probe_values(v: ProbeValues, *, b0: int, s0: int) -> Poly:
    """Return the exact polynomial through the five probe values.

    A tensor's size or an op's FLOPs is linear or constant in b, at most quadratic in s (attention scores),
    and its tensor-parallel part scales as 1/t: value = (b/b0)^i * q(s) * (R + S/t). Three sequence lengths fix
    q, the batch ratio fixes i (it must be 1 or 2), and the widened model fixes the split R + S = 1.
    """
    if v.base == v.longer == v.longest == v.wider == v.widened == 0:
        return Poly()
    if v.base == 0:
        raise ValueError("a measured quantity is zero at the base probe only")
    ratio = Fraction(v.wider, v.base)
    if ratio not in (1, 2):
        raise ValueError(f"a measured quantity is not linear in micro-batch (ratio {ratio})")
    i = 1 if ratio == 2 else 0
    sharded = Fraction(v.widened - v.base, v.base)
    split = {0: 1 - sharded, 1: sharded}
    b_scale = Fraction(1, b0**i)
    q = _quadratic_through((s0, v.base), (2 * s0, v.longer), (3 * s0, v.longest))
    terms: dict[Monomial, Fraction] = {}
    for j, coeff in enumerate(q):
        for k, part in split.items():
            terms[(i, j, k)] = terms.get((i, j, k), Fraction(0)) + coeff * part * b_scale
    return Poly.of(terms)


def _quadratic_through(*points: tuple[int, int]) -> tuple[Fraction, Fraction, Fraction]:
    """Coefficients (c0, c1, c2) of the parabola through three points (Lagrange form, exact)."""
    (x0, y0), (x1, y1), (x2, y2) = points
    c = [Fraction(0)] * 3
    for xa, ya, xb, xc in ((x0, y0, x1, x2), (x1, y1, x0, x2), (x2, y2, x0, x1)):
        denominator = Fraction(ya, (xa - xb) * (xa - xc))
        c[0] += denominator * xb * xc
        c[1] -= denominator * (xb + xc)
        c[2] += denominator
    return c[0], c[1], c[2]
