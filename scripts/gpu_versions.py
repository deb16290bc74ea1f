"""The GPU check's environment: what the machine's torch says about CUDA, cuDNN, NCCL and the GPU.

    python3 scripts/gpu_versions.py OUT.json [--no-gpu-ok]

Writes one JSON object; exits 1 (after writing what it found) when torch or a GPU is missing
(with --no-gpu-ok, as the CPU rehearsal passes it, only when torch is).
"""
import json
import subprocess
import sys

found = {}
status = 0
try:
    import torch

    found.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        found.update(
            gpu=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    elif "--no-gpu-ok" not in sys.argv[2:]:
        status = 1
except ImportError as e:
    found["error"] = f"no torch: {e}"
    status = 1
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=10)
    found["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
except (OSError, subprocess.TimeoutExpired) as e:
    found["nvidia_smi"] = f"unavailable: {e}"
json.dump(found, open(sys.argv[1], "w"))
print(json.dumps(found))
sys.exit(status)
