"""From another planner: sweep GPU counts and keep the smallest cluster that fits a 70B fine-tune."""

from solver import Infeasible, solve

for count in (1, 2, 4, 8, 16, 32):
    try:
        plan = solve("meta-llama/Llama-3.1-70B", f"{count}xH100", seq_len=2048, global_batch=64, time_limit=30)
    except Infeasible as why:
        print(f"{count:3} x H100: does not fit ({why.diagnosis.get('least_allocated_bytes', 0) / 2**30:.0f} GiB "
              "needed per GPU at best)")
        continue
    print(f"{count:3} x H100: fits, {plan.estimate.time.step_time:.1f} s/step -> {plan.decisions.summary()}")
    break
