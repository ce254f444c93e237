"""Each matmul's own reduction width: column-parallel GEMMs keep K = hidden under tensor parallelism, row-parallel
ones divide it (Shoeybi et al. 2019). The size factor used to take hidden / tp for every GEMM."""

from __future__ import annotations

import pytest

from costmodels.compute import _size_factor, reduction_width
from costmodels.timing import layer_gemms
from graphs import lower


def test_one_gemm_has_its_own_width():
    assert reduction_width([(1, 4096, 1000)]) == pytest.approx(1000)


def test_the_width_reproduces_the_summed_time_of_the_gemms():
    gemms = [(1, 8192, 8192), (1, 1024, 8192), (1, 8192, 1024), (2, 28672, 8192), (1, 8192, 3584), (1, 4096, 16)]
    width = reduction_width(gemms)
    tokens = 4096
    time_each = sum(w * n * k / _size_factor(tokens, k) for w, n, k in gemms)
    time_joint = sum(w * n * k for w, n, k in gemms) / _size_factor(tokens, width)
    assert time_joint == pytest.approx(time_each, rel=1e-12)


def test_column_parallel_gemms_keep_the_whole_reduction_under_tensor_parallelism():
    graph = lower("meta-llama/Llama-3.1-70B")
    layer = graph.decoder_layers()[0]
    hidden, ffn = graph.dims.hidden, graph.dims.intermediate
    gemms = {(g.n, g.k) for g in layer_gemms(layer, 8)}
    assert (hidden // 8, hidden) in gemms  # q_proj: column-parallel, K = hidden
    assert (hidden, ffn // 8) in gemms  # down_proj: row-parallel, K = ffn / 8
    widths = {tp: reduction_width([(g.routed, g.n, g.k) for g in layer_gemms(layer, tp)]) for tp in (1, 8)}
    assert 4 * hidden // 8 < widths[8] < widths[1]
