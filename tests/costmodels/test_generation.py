"""GRPO's generation engine (`costmodels/generation.py`): vLLM's KV sizing rules and the decode roofline."""

from __future__ import annotations

import pytest

from costmodels import generation as G
from costmodels.hardware import find_gpu

SHAPE = G.ModelShape(params=7_615_616_512, weight_bytes=2 * 7_615_616_512, layers=28, kv_heads=4, head_dim=128,
                     hidden=3584, intermediate=18944, vocab=152064)  # Qwen2.5-7B's published config


@pytest.fixture(scope="module")
def h100():
    return find_gpu("h100-sxm-80gb")


def test_kv_blocks_fill_the_share_left_after_weights_and_profile_peak(h100):
    engine = G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.5)
    free = G.kv_cache_bytes(SHAPE, engine, h100)
    blocks = G.kv_blocks(SHAPE, engine, h100)
    block = G.page_bytes(SHAPE, engine) * SHAPE.layers
    assert blocks * block <= free < (blocks + 1) * block
    # a larger share adds exactly its bytes to the cache
    more = G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.6)
    assert G.kv_cache_bytes(SHAPE, more, h100) - free == pytest.approx(0.1 * h100.memory_bytes, abs=2)
    # too small a share leaves no cache (weights alone are 14.2 GiB)
    assert G.kv_cache_bytes(SHAPE, G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.1), h100) == 0


def test_decode_is_memory_bound_at_small_batch_and_cheaper_per_sequence_as_batch_grows(h100):
    engine = G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.5)
    one = G.decode_step_seconds(SHAPE, engine, h100, batch=1, context=1)
    assert one == pytest.approx(SHAPE.weight_bytes / (h100.hbm_bandwidth * G.MEMORY_EFFICIENCY), rel=1e-3)
    per_sequence = [G.decode_step_seconds(SHAPE, engine, h100, batch=b, context=1024) / b for b in (1, 8, 64, 512)]
    assert per_sequence == sorted(per_sequence, reverse=True)
    # tensor parallelism splits the bytes each GPU reads
    tp2 = G.Engine(placement=G.Placement.COLOCATE, tp=2, utilization=0.5)
    assert G.decode_step_seconds(SHAPE, tp2, h100, batch=1, context=1) == pytest.approx(one / 2, rel=1e-3)


def test_sequences_beyond_the_kv_cache_run_in_waves(h100):
    small = G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.22)
    room = G.concurrent_sequences(SHAPE, small, h100, seq_len=4096)
    assert 1 <= room < 256
    timed = G.generation_time(SHAPE, small, h100, engine_gpus=1, completions=4 * room, prompt=512, completion=3584)
    assert timed is not None and timed.waves == 4 and timed.concurrent == room
    assert G.generation_time(SHAPE, G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.1), h100,
                             engine_gpus=1, completions=8, prompt=512, completion=512) is None


def test_sleep_mode_and_server_hold_nothing_on_training_gpus(h100):
    held = G.engine_resident_bytes(G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.3), h100.memory_bytes)
    assert held == int(0.3 * h100.memory_bytes)
    assert G.engine_resident_bytes(G.Engine(placement=G.Placement.COLOCATE, tp=1, utilization=0.3, sleep=True),
                                   h100.memory_bytes) == 0
    assert G.engine_resident_bytes(G.Engine(placement=G.Placement.SERVER, tp=1, utilization=0.92),
                                   h100.memory_bytes) == 0
