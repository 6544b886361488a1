"""Which import poisons a process's forks for CUDA (run on a GPU machine, repository root):
`python3 experiments/gpu_smoke/fork_probe.py [nvml]`. Records every `cudaGetDeviceCount`
(torch._C._cuda_getDeviceCount, the call that registers torch's fork poisoning) with its
stack while importing what the rank server imports, then forks and asks the child whether
CUDA works there. `nvml`: with PYTORCH_NVML_BASED_CUDA_CHECK=1 set during the imports."""

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
calls = []
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    original = getattr(torch._C, name)

    def wrapped(*a, _original=original, _name=name):
        calls.append((_name, "".join(traceback.format_stack(limit=10)[:-1])))
        return _original(*a)

    setattr(torch._C, name, wrapped)
if sys.argv[1:] == ["nvml"]:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
import framework.train.worker  # noqa: E402,F401
import framework.train.trainer  # noqa: E402,F401
import matplotlib.pyplot  # noqa: E402,F401

os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
print(f"{len(calls)} poisoning calls during the imports; CUDA initialised: {torch.cuda.is_initialized()}")
for name, stack in calls[:4]:
    print(f"--- {name}\n{stack}")
pid = os.fork()
if pid == 0:
    try:
        torch.zeros(1, device="cuda")
        print("forked child: CUDA works")
    except RuntimeError as e:
        print(f"forked child: {e}")
    os._exit(0)
os.waitpid(pid, 0)
