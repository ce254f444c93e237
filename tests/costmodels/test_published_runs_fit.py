"""Issue 37: a published run that ran must not be called "does not fit". Every modelled row of the calibration data
(benchmarks/data/calibration/throughput_published.json) is priced as benchmarks/fidelity.py prices it and judged on
its own card with no headroom (the run used the whole card).

A ratchet, not a waiver: the rows fitplan still refuses are listed with the known cause and marked strict xfail,
so a row that starts to fit fails the test until it leaves the list, and any other row that stops fitting fails.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import fidelity

ROWS = {row["id"]: row for row in json.loads((fidelity.DATA / "throughput_published.json").read_text())}
# Refused today (2026-12-06), with the cause found so far (docs/fidelity.md "Runs called 'does not fit'"). Priced as
# their runtimes run them (fitplan's route; Megatron's and Mist's fp16 vocab-parallel cross-entropy, Megatron's fp16
# gradient buffer, llm-foundry's flash-attn cross-entropy), 16 of the 33 rows refused before fit.
MIST_OFFLOAD = ("Mist offloads part of its stages' optimizer states to the CPU (the row's offload ratios), which "
                "fitplan prices on the GPU")
MIST_STAGES = ("Mist's runtime, no offload: fitplan prices its stages above Mist's own measured per-stage peaks "
               "(docs/fidelity.md 'Pipelined stages against Mist', +25% median); where is not found yet")
MEGATRON_STEP = ("Megatron-LM core_r0.4.0 at --fp16: the allocated peak (fp16 weights and gradient buffer, sharded "
                 "fp32 states, at the step the fp32 copy of the shard's gradients) and the priced CUDA context and "
                 "NCCL allowance exceed the L4 by under 1 GiB")
MPT_STAND_IN = ("llm-foundry's MPT priced on a GPT-NeoX stand-in (transformers' MPT has no SDPA path): its attention "
                "keeps the whole qkv output and rotary copies of q and k that MPT's ALiBi flash path does not; "
                "llm-foundry's own layers are not lowered here, so what they keep is unchecked")
KNOWN_REFUSED = {
    **{rid: MIST_OFFLOAD for rid in ("mist_l4_gpt_7b_flashFalse", "mist_l4_gpt_7b_flashTrue",
                                     "mist_l4_llama_7b_flashTrue")},
    **{rid: MIST_STAGES for rid in ("mist_l4_gpt_1.3b_flashTrue", "mist_l4_gpt_2.7b_flashFalse",
                                    "mist_l4_gpt_2.7b_flashTrue")},
    **{f"mist_l4_megatron_baseline_{rid}": MEGATRON_STEP for rid in (
        "gpt_2.7b_flashFalse", "gpt_2.7b_flashTrue", "gpt_7b_flashFalse", "gpt_7b_flashTrue", "llama_2.7b_flashTrue",
        "llama_7b_flashTrue")},
    **{rid: MPT_STAND_IN for rid in (
        "mosaic_h100_80gb_1b_s2048_g64_mb20_ga1_bf16", "mosaic_a100_40gb_1b_s2048_g64_mb10_ga1_bf16",
        "mosaic_a100_40gb_760m_s8192_g8_mb3_ga4_bf16", "mosaic_a100_40gb_760m_s1024_g8_mb24_ga4_bf16",
        "mosaic_a100_40gb_350m_s2048_g32_mb18_ga1_bf16")},
}


def cases() -> list:
    return [pytest.param(rid, marks=pytest.mark.xfail(strict=True, reason=KNOWN_REFUSED[rid]))
            if rid in KNOWN_REFUSED else rid for rid in ROWS]


@pytest.mark.slow
@pytest.mark.parametrize("rid", cases())
def test_a_published_run_that_ran_fits_its_card(rid, tmp_path):
    priced = fidelity.time_row(ROWS[rid], tmp_path)
    assert "reason" not in priced, priced  # every row's configuration is expressed
    assert priced["fits"], (f"{rid}: device peak {priced['device_peak'] / 2**30:.1f} GiB > "
                            f"{priced['capacity'] / 2**30:.1f} GiB")
