#!/usr/bin/env bash
# What ran on the lent GPU machine (one H200, torch preinstalled there, no network): the kernel benchmarks, then
# the plans made here by `plans.py make .gpu/plans`, with transformers/peft wheels of this project's versions
# carried in .whl (the machine's own are used if those do not import). Results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
log="$OUT/log.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
if ! python3 -c "import transformers, peft; print('transformers', transformers.__version__, 'peft', peft.__version__)" \
    >>"$log" 2>&1; then
    echo "carried wheels do not import: using the machine's own" >>"$log"; unset PYTHONPATH
    python3 -c "import transformers, peft; print('transformers', transformers.__version__, 'peft', peft.__version__)" >>"$log" 2>&1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv >>"$log" 2>&1
python3 benchmarks/gpu/kernels.py "$OUT/kernels.json" >>"$log" 2>&1
python3 benchmarks/gpu/plans.py run .gpu/plans "$OUT/plans.json" --budget "${PLAN_BUDGET:-330}" >>"$log" 2>&1
echo "done" >>"$log"
