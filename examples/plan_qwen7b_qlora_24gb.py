"""Plan Qwen2.5-7B with QLoRA (4-bit NF4 base, double quantisation, rank 16) and bitsandbytes' paged 8-bit AdamW
on one 24 GB RTX 4090, and write the Hugging Face Trainer files that run it."""

import sys
import tempfile
from pathlib import Path

from graphs import LoraSpec
from solver import solve
from solver.plan.launchers import emit

qlora = LoraSpec(rank=16, alpha=32, quantization="nf4", double_quant=True)
plan = solve("Qwen/Qwen2.5-7B", "1xRTX4090", seq_len=2048, global_batch=16, lora=qlora,
             optimizers="paged-adamw-8bit", launcher="hf")
print(plan.decisions.summary())
memory = plan.estimate.memory
print(f"device peak {memory.device_peak / 2**30:.1f} GiB of 24 GiB; base weights {memory.parameters / 2**30:.1f} GiB "
      f"(4-bit); optimizer states on the GPU {memory.optimizer_states / 2**20:.0f} MiB (the rest paged)")
folder = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fitplan-qlora-"))
for name, text in emit(plan, "hf").items():
    (folder / name).write_text(text)
print(f"wrote {', '.join(sorted(p.name for p in folder.iterdir()))} to {folder}")
print("load: AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig.from_dict("
      "json.load(open('quantization_config.json')))), get_peft_model(model, LoraConfig.from_pretrained(folder)), "
      "Trainer(args=TrainingArguments(**json.load(open('training_args.json'))), ...)")
