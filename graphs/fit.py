"""Turn four probe recordings into exact per-segment costs.

The probes are (b0, s0), (b0, 2*s0), (b0, 3*s0), (2*b0, s0) on the model and (b0, s0) on the model widened to
twice its heads and FFN width (what one rank would hold at t = 1/2; widening, unlike narrowing, never creates
a size-1 dimension that changes the code path). The op and allocation sequences are identical across probes
(they are checked), so each storage's size and each op's FLOPs become one polynomial (`poly.fit_probe_values`),
and every per-segment quantity is an exact sum of those.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layer import ModeCost, Work
from .poly import ZERO, PeakPoly, Poly, ProbeValues, fit_probe_values
from .probe import MODEL_WIDE, Recording
from .recorder import launches_kernel


@dataclass(frozen=True, slots=True)
class Probes:
    """The five recordings; `widened` is None when the model has no clean TP plan (nothing splits)."""

    base: Recording
    longer: Recording
    longest: Recording
    wider: Recording
    widened: Recording | None

    def others(self) -> list[Recording]:
        return [self.longer, self.longest, self.wider] + ([self.widened] if self.widened else [])


def _check_aligned(probes: Probes) -> None:
    names = [op.name for op in probes.base.ops]
    for run in probes.others():
        if [op.name for op in run.ops] != names or len(run.storages) != len(probes.base.storages):
            raise RuntimeError(f"probe at b={run.b}, s={run.s} ran a different op sequence; "
                               "the model's code path depends on the shape")


def _fit(probes: Probes, values: list[int]) -> Poly:
    """Fit one quantity measured at base, longer, longest, wider (and widened, else replicated)."""
    base, longer, longest, wider = values[:4]
    widened = values[4] if len(values) > 4 else base
    return fit_probe_values(ProbeValues(base, longer, longest, wider, widened), b0=probes.base.b, s0=probes.base.s)


def storage_polys(probes: Probes) -> list[Poly]:
    _check_aligned(probes)
    runs = [probes.base, *probes.others()]
    return [_fit(probes, [run.storages[i].nbytes for run in runs]) for i in range(len(probes.base.storages))]


def op_works(probes: Probes) -> list[Work]:
    """Per op: FLOPs (and the attention part) and memory-bound bytes, as polynomials."""
    runs = [probes.base, *probes.others()]
    works = []
    for i, op in enumerate(probes.base.ops):
        flops = _fit(probes, [run.ops[i].flops for run in runs])
        io = ZERO
        if not op.flops:
            for k in range(len(op.io)):
                io = io + _fit(probes, [run.ops[i].io[k] for run in runs])
        works.append(Work(flops=flops, attention_flops=flops if op.flop_class == "attention" else ZERO,
                          io_bytes=io, kernels=Poly.const(1) if launches_kernel(op) else ZERO))
    return works


@dataclass(slots=True)
class _Timeline:
    """Live bytes after each op's allocations (peak moment) and after its frees, per gradient treatment."""

    peak: list[Poly]
    after: list[Poly]
    grads_at: list[Poly]  # gradient bytes allocated by each op


def first_backward(rec: Recording) -> int:
    """Index of the pass's first backward op (the op count when there is none): where backward starts."""
    return next((k for k, op in enumerate(rec.ops) if op.backward), len(rec.ops))


def released_after_forward(rec: Recording) -> set[int]:
    """Storages that die when the forward call returns (autocast's cast cache, the top-level forward's locals):
    they stay alive through the rest of the forward wherever they were made, and go before backward starts."""
    start = first_backward(rec)
    return {i for i, st in enumerate(rec.storages) if st.free_after == start and not st.grad
            and i not in rec.global_storages}


def _timeline(rec: Recording, sizes: list[Poly]) -> _Timeline:
    allocs: list[list[int]] = [[] for _ in rec.ops]
    frees: list[list[int]] = [[] for _ in rec.ops]
    kept = released_after_forward(rec)
    for i, st in enumerate(rec.storages):
        if i in rec.global_storages:
            continue
        allocs[st.alloc_op].append(i)
        if st.free_after is not None and not st.grad and i not in kept:
            frees[min(st.free_after, len(rec.ops)) - 1].append(i)
    live = ZERO
    peak, after, grads_at = [], [], []
    for k in range(len(rec.ops)):
        new = [i for i in allocs[k] if not rec.storages[i].grad]
        grad = [i for i in allocs[k] if rec.storages[i].grad]
        live = live + _sum(sizes, new)
        peak.append(live)
        grads_at.append(_sum(sizes, grad))
        live = live - _sum(sizes, frees[k])
        after.append(live)
    return _Timeline(peak, after, grads_at)


def _sum(sizes: list[Poly], indices: list[int]) -> Poly:
    total = ZERO
    for i in indices:
        total = total + sizes[i]
    return total


def segments(rec: Recording) -> dict[tuple[str, bool], range]:
    """The op range of each (scope, backward) segment; segments must be contiguous."""
    spans: dict[tuple[str, bool], range] = {}
    start = 0
    for k in range(1, len(rec.ops) + 1):
        if k == len(rec.ops) or (rec.ops[k].scope, rec.ops[k].backward) != (rec.ops[start].scope,
                                                                           rec.ops[start].backward):
            key = (rec.ops[start].scope, rec.ops[start].backward)
            if key in spans:
                raise RuntimeError(f"segment {key} is not contiguous")
            spans[key] = range(start, k)
            start = k
    return spans


class _Pareto:
    """Collect candidate peaks, dropping those another candidate dominates."""

    def __init__(self) -> None:
        self.kept: list[Poly] = []

    def add(self, poly: Poly) -> None:
        if any(poly.dominated_by(other) for other in self.kept):
            return
        self.kept = [other for other in self.kept if not other.dominated_by(poly)] + [poly]

    def result(self) -> PeakPoly:
        return PeakPoly(tuple(sorted(self.kept, key=lambda p: p.terms)))


def segment_costs(probes: Probes, *, module_held: bool = False) -> dict[str, ModeCost]:
    """Costs of every scope of the trace model (trace layers are named "layers.<i>"). A scope's saved bytes are
    the storages only it saved for backward. With `module_held` (megatron's MoE layers), only those still alive
    when backward starts (autograd drops what a dead branch saved: megatron's aux-loss top-k), and also the
    storages its forward made that nothing saved and that outlive the forward, which a module keeps as attributes
    until its next forward or its recompute (megatron's MoE dispatcher keeps the routing map, probabilities,
    permutation and counts)."""
    rec = probes.base
    sizes = storage_polys(probes)
    works = op_works(probes)
    line = _timeline(rec, sizes)
    spans = segments(rec)
    backward = first_backward(rec)
    saved: dict[str, Poly] = {}
    for i, st in enumerate(rec.storages):
        if i in rec.global_storages or (module_held and st.free_after is not None and st.free_after <= backward):
            continue
        op = rec.ops[st.alloc_op]
        if len(st.savers) == 1:
            saved[st.savers[0]] = saved.get(st.savers[0], ZERO) + sizes[i]
        elif module_held and not st.savers and not op.backward \
                and op.scope.startswith("layers."):
            saved[op.scope] = saved.get(op.scope, ZERO) + sizes[i]
    released: dict[str, Poly] = {}
    for i in released_after_forward(rec):
        scope = rec.ops[rec.storages[i].alloc_op].scope
        released[scope] = released.get(scope, ZERO) + sizes[i]
    costs = {}
    for scope in dict.fromkeys(scope for scope, _ in spans):
        if scope == "inputs":
            continue
        fwd = spans.get((scope, False), range(0))
        bwd = spans.get((scope, True), range(0))
        f_peak, f_net, _, _, _ = _segment_memory(line, fwd)
        b_peak, b_net, b_fresh, grads, _ = _segment_memory(line, bwd)
        costs[scope] = ModeCost(
            saved=saved.get(scope, ZERO),
            forward=_work(works, rec, fwd, recompute=False),
            backward=_work(works, rec, bwd, recompute=False),
            recompute=_work(works, rec, bwd, recompute=True),
            fwd_peak=f_peak, fwd_net=f_net, released_after_forward=released.get(scope, ZERO), bwd_peak=b_peak,
            bwd_peak_fresh=b_fresh, bwd_net=b_net, grads=grads)
    return costs


def model_wide_bytes(probes: Probes) -> dict[str, Poly]:
    """Bytes of model-wide tensors by lifetime (see `probe.MODEL_WIDE`)."""
    sizes = storage_polys(probes)
    lifetimes = probes.base.global_storages
    return {kind: _sum(sizes, [i for i, k in lifetimes.items() if k == kind]) for kind in MODEL_WIDE}


def _work(works: list[Work], rec: Recording, span: range, *, recompute: bool) -> Work:
    total = Work()
    for k in span:
        if rec.ops[k].recompute == recompute:
            total = total + works[k]
    return total


def _segment_memory(line: _Timeline, span: range) -> tuple[PeakPoly, Poly, PeakPoly, Poly, Poly]:
    """(peak with grads handed off, net without grads, peak with fresh grads kept, grads, entry live)."""
    if not span:
        return PeakPoly(), ZERO, PeakPoly(), ZERO, ZERO
    entry = line.after[span.start - 1] if span.start > 0 else ZERO
    handed_off, fresh = _Pareto(), _Pareto()
    grads = ZERO
    for k in span:
        base = line.peak[k] - entry
        handed_off.add(base + line.grads_at[k])
        grads = grads + line.grads_at[k]
        fresh.add(base + grads)
    return handed_off.result(), line.after[span[-1]] - entry, fresh.result(), grads, entry
