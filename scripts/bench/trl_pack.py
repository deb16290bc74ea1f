"""TRL's TreeRow on the packer workload of benches/tree_vs_flat.rs, for it to compare against.

    python scripts/bench/trl_pack.py GROUPS ROLLOUTS_PER_GROUP PROMPT_TOKENS COMPLETION_TOKENS

GROUPS groups of ROLLOUTS_PER_GROUP rollouts, each a shared prompt of PROMPT_TOKENS random ids
and its own COMPLETION_TOKENS (trained) ids, vocabulary 150,000: the shape the Rust bench packs.
Times `TreeRow.add` of every rollout plus `TreeRow.pack` (rollout tensors made beforehand, as
the Rust side moves ready rollouts in). Prints one JSON line: best of 3 milliseconds, tokens.
"""
import json
import sys
import time

import torch
from trl.experimental.async_grpo.packing import TreeRow

groups, per_group, prompt, completion = (int(a) for a in sys.argv[1:5])
gen = torch.Generator().manual_seed(7)
samples = []
for g in range(groups):
    prefix = torch.randint(3, 150_000, (prompt,), generator=gen)
    for _ in range(per_group):
        ids = torch.cat([prefix, torch.randint(3, 150_000, (completion,), generator=gen)])
        n = ids.numel()
        samples.append({
            "input_ids": ids,
            "completion_mask": (torch.arange(n) >= prompt).long(),
            "old_log_probs": -torch.rand(n, generator=gen) * 4 - 1,
            "advantage": float(torch.rand(1, generator=gen)) * 2 - 1,
            "group_id": str(g),
        })
raw = sum(s["input_ids"].numel() for s in samples)
times = []
for _ in range(3):
    t = time.perf_counter()
    row = TreeRow()
    for s in samples:
        row.add(s)
    packed = row.pack()
    times.append(time.perf_counter() - t)
ms = min(times) * 1e3
print(json.dumps({"tree_ms": ms, "raw_tokens": raw, "unique_tokens": int(packed["input_ids"].numel()),
                  "mtokens_per_s": raw / ms / 1e3, "trl": __import__("trl").__version__}))
