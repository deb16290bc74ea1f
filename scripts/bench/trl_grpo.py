"""TRL's GRPOTrainer on CPU for benches/grpo.rs: the same model, prompts and recipe.

    python scripts/bench/trl_grpo.py MODEL_DIR DATA.parquet PROMPTS STEPS

`PROMPTS` prompts x 8 completions a step (one optimizer step per generated batch), completions
of at most 16 tokens sampled at temperature 1 with transformers' `generate` (TRL without vLLM),
learning rate 1e-3, fp32, CPU, no gradient checkpointing (TRL turns it on by default; treetrain's
recipe keeps activations), TRL's defaults otherwise (its loss, no KL term). The rewards are
the shipped recipe's, written again here: `exact_answer` (1 when the text after the last
"Answer:" equals the row's answer; weight 1) and `answer_format` (1 for one line "Answer: ..."
ended by EOS; weight 0.5). Prints one JSON line: the mean seconds per step over the steps after
2 warm-up steps.
"""
import json
import sys
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, data, prompts, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def answer_of(text):
    tail = text.rsplit("Answer:", 1)[-1]
    return tail.strip().rstrip(".").strip()


def text_of(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(completions, answer, **kwargs):
    return [1.0 if answer_of(text_of(c)) == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def answer_format(completions, completion_ids, **kwargs):
    out = []
    for c, ids in zip(completions, completion_ids):
        text = text_of(c).strip()
        rest = text[len("Answer:"):] if text.startswith("Answer:") else None
        ok = len(ids) < 16 and "\n" not in text and rest is not None and rest.strip() != "" and "Answer:" not in rest
        out.append(1.0 if ok else 0.0)
    return out


class Clock(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ds = load_dataset("parquet", data_files=data, split="train")
cfg = GRPOConfig(output_dir="/tmp/trl-grpo-bench", num_generations=8, per_device_train_batch_size=8 * prompts,
                 max_completion_length=16, temperature=1.0, learning_rate=1e-3, beta=0.0,
                 reward_weights=[1.0, 0.5], max_steps=steps + 2, use_cpu=True, bf16=False, report_to=[],
                 save_strategy="no", logging_steps=1000, dataloader_num_workers=0, seed=7,
                 gradient_checkpointing=False)
clock = Clock()
trainer = GRPOTrainer(model=model, reward_funcs=[exact_answer, answer_format], args=cfg, train_dataset=ds,
                      processing_class=tok, callbacks=[clock])
start = time.perf_counter()
trainer.train()
t = clock.times
step_s = (t[-1] - t[1]) / max(len(t) - 2, 1)
print(json.dumps({"step_s": step_s, "steps": len(t) - 2, "threads": torch.get_num_threads()}))
