"""Plan Llama-3.1-70B on two nodes of 8 H100s: parallelism, sharding, checkpointing, and where memory goes."""

from solver import solve

plan = solve("meta-llama/Llama-3.1-70B", "2x8xH100", seq_len=4096, global_batch=128)
memory, time = plan.estimate.memory, plan.estimate.time
print(plan.decisions.summary())
print(f"device peak {memory.device_peak / 2**30:.1f} GiB per GPU, step {time.step_time:.2f} s, "
      f"{plan.estimate.tokens_per_second:,.0f} tokens/s, MFU {plan.estimate.mfu:.1%} ({plan.solver.status})")
