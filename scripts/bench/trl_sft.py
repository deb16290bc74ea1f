"""TRL's SFTTrainer on CPU for benches/sft.rs: the same tiny model, data and packing.

    python scripts/bench/trl_sft.py MODEL_DIR DATA.parquet STEPS [kept|checkpointing]

bfd packing into 256-token rows, 8 rows a step, assistant-only loss, AdamW lr 2e-3, fp32, CPU.
Prints one JSON line: trained-on tokens per second over the steps after 2 warm-up steps.
"""
import json
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

model_dir, data, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
checkpointing = len(sys.argv) > 4 and sys.argv[4] == "checkpointing"


class Clock(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ds = load_dataset("parquet", data_files=data, split="train")
cfg = SFTConfig(output_dir="/tmp/trl-sft-bench", max_length=256, packing=True, packing_strategy="bfd",
                per_device_train_batch_size=8, max_steps=steps + 2, learning_rate=2e-3, lr_scheduler_type="cosine",
                warmup_steps=1, assistant_only_loss=True, report_to=[], use_cpu=True, save_strategy="no",
                logging_steps=1000, dataloader_num_workers=0, seed=42, bf16=False,
                gradient_checkpointing=checkpointing)
clock = Clock()
trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[clock])
lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
trainer.train()
elapsed = clock.times[-1] - clock.times[1]
tokens_per_step = 8 * sum(lengths) / len(lengths)
print(json.dumps({"tokens_per_s": tokens_per_step * (len(clock.times) - 2) / elapsed, "steps": len(clock.times),
                  "rows": len(lengths), "mean_row_tokens": sum(lengths) / len(lengths),
                  "torch": torch.__version__, "trl": __import__("trl").__version__}))
