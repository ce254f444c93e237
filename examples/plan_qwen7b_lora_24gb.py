"""Plan Qwen2.5-7B with LoRA (rank 16 on all linear layers) on one 24 GB GPU."""

from graphs import LoraSpec
from solver import solve

plan = solve("Qwen/Qwen2.5-7B", "1xA10G", seq_len=2048, global_batch=32, lora=LoraSpec(rank=16, alpha=32))
print(plan.decisions.summary())
print(f"trainable LoRA, device peak {plan.estimate.memory.device_peak / 2**30:.1f} GiB of 24 GiB")
for line in plan.advice:
    print(" -", line)
