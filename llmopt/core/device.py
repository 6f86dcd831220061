"""`resolve_device(name)`: the one place a `--device` value becomes a `torch.device`.

"auto" (every command's default) is the first CUDA GPU where torch sees one, else the CPU.
"cuda:N" is checked against the GPUs present and made the current CUDA device, so kernels
launched without an explicit device (Triton's, `torch.cuda` streams and events) run on GPU N
too rather than on GPU 0.
"""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError

DEVICE_HELP = "auto (CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N"


def parse_device(name: str = "auto") -> torch.device:
    """The device `name` names, without asking whether this machine has it ("auto" is resolved);
    LlmoptError (exit 2) for a bad name. Checks of a plan that may run elsewhere (a recipe for a
    GPU validated on a laptop) use this; running code uses `resolve_device`."""
    text = (name or "auto").strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise LlmoptError(f"unknown --device {name!r}; choose {DEVICE_HELP}") from None
    if device.type not in ("cpu", "cuda"):
        raise LlmoptError(f"unknown --device {name!r}; choose {DEVICE_HELP}")
    return device


def resolve_device(name: str = "auto", make_current: bool = True) -> torch.device:
    """The device `name` means here; LlmoptError (exit 2) for a bad name or an absent GPU.

    `make_current`: for a CUDA device, also make it the current one (`torch.cuda.set_device`);
    code that only checks a value before handing it to another process passes False."""
    device = parse_device(name)
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise LlmoptError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, {build})")
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise LlmoptError(f"--device {name}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    if make_current:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)
