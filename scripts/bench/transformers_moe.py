"""transformers' Qwen3-MoE sparse block, forward + backward, for benches/moe.rs.

    python transformers_moe.py '{"tokens": 2048, "hidden": 2048, "experts": 128, "top_k": 8,
        "width": 768, "dtype": "float32", "seed": 7, "iters": 3, "implementation": "grouped_mm"}'

The weights, the input and the output's gradient are drawn exactly as benches/moe.rs draws them
(the same libtorch generator, seed and order), so both sides run the same block on the same
numbers. Gradients are set to `None` between passes (`"grads": "none"`, PyTorch's `zero_grad`
and treetrain's trainers) or kept and zeroed (`"grads": "keep"`). Prints one JSON line: the
median seconds of `iters` timed forward + backward passes
(after one untimed, glibc keeping freed memory), the resident peak of one more pass (every large
tensor mapped on its own) over the resident memory before the weights were made (MiB), and
checksums of the output and the gradients.
"""

import ctypes
import json
import statistics
import sys
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return float(line.split()[1])
    return 0.0


def allocator(mode):
    """glibc's allocator as benches/common sets it: `time` keeps freed memory, `measure` maps
    every large tensor on its own and returns it on free (honest resident peaks)."""
    libc = ctypes.CDLL("libc.so.6")
    mmap, trim = (64 << 20, 1 << 30) if mode == "time" else (256 << 10, 1 << 20)
    libc.mallopt(-3, mmap)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, trim)  # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def main():
    a = json.loads(sys.argv[1])
    dtype = getattr(torch, a["dtype"])
    torch.set_num_threads(a.get("threads", torch.get_num_threads()))
    before = status_kib("VmRSS:")
    config = Qwen3MoeConfig(
        hidden_size=a["hidden"],
        num_experts=a["experts"],
        num_experts_per_tok=a["top_k"],
        moe_intermediate_size=a["width"],
        norm_topk_prob=True,
    )
    config._experts_implementation = a["implementation"]
    block = Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(a["seed"])
    e, h, i, t = a["experts"], a["hidden"], a["width"], a["tokens"]
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, h) * 0.02)
        block.experts.gate_up_proj.copy_(torch.randn(e, 2 * i, h) * 0.02)
        block.experts.down_proj.copy_(torch.randn(e, h, i) * 0.02)
    x0 = torch.randn(1, t, h).to(dtype)
    dy = torch.randn(1, t, h).to(dtype)
    block.to(dtype)

    def step():
        # "none": set to None, as PyTorch's `zero_grad` and treetrain's side do; "keep": kept
        # and zeroed, so the backward adds into them.
        for p in block.parameters():
            if a.get("grads", "none") == "none":
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        x = x0.clone().requires_grad_(True)
        y = block(x)
        y.backward(dy)
        return x, y

    allocator("time")
    step()
    times = []
    for _ in range(a["iters"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    allocator("measure")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    x, y = step()
    peak = status_kib("VmHWM:")
    print(
        json.dumps(
            {
                "seconds": statistics.median(times),
                "times": times,
                "peak_mib": (peak - before) / 1024,
                "y_sum": y.float().sum().item(),
                "x_grad_sum": x.grad.float().abs().sum().item(),
                "gate_up_grad_sum": block.experts.gate_up_proj.grad.float().abs().sum().item(),
                "router_grad_sum": block.gate.weight.grad.float().abs().sum().item(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
            }
        )
    )


main()
