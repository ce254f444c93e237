"""Which GPUs to rent: time and cost to train Llama-3.1-8B on 1B tokens over GPU types and counts."""

from solver.choose import choose

choice = choose("meta-llama/Llama-3.1-8B", 1e9, gpu_types=["A100-80GB", "L40S"], max_gpus=16, seq_len=4096,
                global_batch=64, deadline_hours=24)
print("Pareto front (time against cost, dated example prices):")
for p in choice.front:
    print(f"  {p.gpus:3} x {p.gpu_name}: {p.hours:5.1f} h, ${p.cost_usd:,.0f}  ({p.summary})")
best = choice.cheapest
if best is not None:
    print(f"cheapest within 24 h: {best.gpus} x {best.gpu_name}, {best.hours:.1f} h, ${best.cost_usd:,.0f}")
for gpu, least in choice.minimum_gpus.items():
    print(f"minimum GPUs of {gpu} for this model at 4096 tokens: {least or 'none up to 16'}")
