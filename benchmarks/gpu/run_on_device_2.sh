#!/usr/bin/env bash
# The second call on the lent GPU machine (what the first left out): the LoRA plans, runs capped at each plan's
# estimated reserved peak, the classic allocator's reserved peaks, and the compiled plan, in that order of
# priority, until the budget is spent.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
log="$OUT/log2.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
python3 -c "import transformers, peft" >>"$log" 2>&1 || unset PYTHONPATH
runs="llama3b-lora16-s4096-mb4:expandable,qwen1.5b-lora16-s2048-mb8-ckpt:expandable"
runs="$runs,gpt2-full-s1024-mb16:expandable:estimate,qwen0.5b-full-s2048-mb8:expandable:estimate"
runs="$runs,llama1b-full-s4096-mb4:expandable:estimate,qwen1.5b-full-s2048-mb8:expandable:estimate"
for case in qwen0.5b-full-s2048-mb8 llama1b-full-s4096-mb4 llama1b-full-s4096-mb8-ckpt qwen1.5b-full-s2048-mb8 \
    llama3b-full-s4096-mb2-selective gpt2-full-s1024-mb16 llama1b-full-s4096-mb8-chunked llama3b-lora16-s4096-mb4; do
    runs="$runs,$case:classic"
done
runs="$runs,qwen0.5b-full-s2048-mb8-compiled:expandable"
python3 benchmarks/gpu/plans.py run .gpu/plans "$OUT/plans2.json" --budget "${PLAN_BUDGET:-200}" --runs "$runs" \
    >>"$log" 2>&1
echo "done" >>"$log"
