"""Plan full fine-tuning of Llama-3.1-8B on 8xA100 for DeepSpeed and print the DeepSpeed config."""

from solver import solve
from solver.plan.launchers import emit

plan = solve("meta-llama/Llama-3.1-8B", "8xA100", seq_len=4096, global_batch=64, launcher="deepspeed")
print(plan.decisions.summary())
print(emit(plan, "deepspeed")["ds_config.json"])
