"""Estimate one fixed configuration (Llama-3.1-8B, ZeRO-3 on 8xA100) and print where the memory goes."""

from solver import estimate

config = {"tp": 1, "dp": 8, "engine": "deepspeed", "zero": 3, "micro_batch": 2, "grad_accum": 4,
          "checkpoint": "full", "precision": "bf16-mixed", "optimizer": "adamw"}
est = estimate("meta-llama/Llama-3.1-8B", "8xA100", config, seq_len=4096)
m = est.memory
for name in ("parameters", "gradients", "optimizer_states", "activations", "temporary"):
    print(f"{name:17} {getattr(m, name) / 2**30:7.2f} GiB")
print(f"allocated peak    {m.allocated_peak / 2**30:7.2f} GiB (at {m.peak_at})")
print(f"device peak       {m.device_peak / 2**30:7.2f} GiB of 80 GiB; step {est.time.step_time:.2f} s")
