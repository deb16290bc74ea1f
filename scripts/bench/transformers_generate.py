"""transformers' greedy generate, for benches/generation.rs to compare against.

    python scripts/bench/transformers_generate.py MODEL_DIR PROMPTS.json MAX_NEW_TOKENS \
        [static|dynamic] [DEVICE (cpu, cuda:0)] [DTYPE (float32, bfloat16)]

Prompts: a JSON list of token-id lists (left-padded here as transformers does). Prints one JSON
line: tokens/s (median of 3 after a warm-up), tokens/s of the decode steps alone (the same
with one new token timed too: the rest of the tokens over the rest of the time), the cache
used, and the generated ids.
"""
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

model_dir, prompts_file, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
cache = sys.argv[4] if len(sys.argv) > 4 else "static"
device = torch.device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
dtype = getattr(torch, sys.argv[6] if len(sys.argv) > 6 else "float32")
prompts = json.load(open(prompts_file))
torch.set_num_threads(torch.get_num_threads())
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
longest = max(map(len, prompts))
ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
              pad_token_id=0, eos_token_id=None)
if cache == "static":
    # Eager steps: on CUDA a static cache would otherwise compile itself (minutes of warm-up
    # the comparison is not about).
    kwargs.update(cache_implementation="static", disable_compile=True)


def timed(**kw):
    times = []
    with torch.no_grad():
        out = model.generate(**kw)
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            out = model.generate(**kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    return out, statistics.median(times)


out, full_s = timed(**kwargs)
_, first_s = timed(**{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
new = out[:, longest:]
tok_s = new.numel() / full_s
decode_tok_s = len(prompts) * (max_new - 1) / max(full_s - first_s, 1e-9)
print(json.dumps({"tokens_per_s": tok_s, "decode_tokens_per_s": decode_tok_s, "cache": cache, "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "device": str(device), "dtype": str(dtype), "outputs": new.tolist()}))
