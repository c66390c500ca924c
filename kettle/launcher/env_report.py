"""`kettle launch --env`: the runtime environment in one block, for bug reports (TGI's `--env`).

Versions come from package metadata and devices from `nvidia-smi`, so the report costs no torch import: the
launcher itself never loads torch.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

import kettle

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "llguidance", "fastapi", "grpcio")
# Settings worth seeing in a report; tokens and keys are never printed.
VARIABLES = ("KETTLE_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES", "LOG_LEVEL")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gpus() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "none (no nvidia-smi)"
    try:
        query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi failed: {error}"
    return "; ".join(out.splitlines()) or "none"


def environment_report() -> str:
    """Lines of `name: value`: Kettle, Python, the platform, key packages, CPU, GPUs, the C compiler, settings."""
    rows = {
        "Kettle": kettle.__version__,
        "Python": f"{platform.python_version()} ({sys.executable})",
        "Platform": platform.platform(),
        **{f"Package {name}": _version(name) for name in PACKAGES},
        "CPU cores": str(os.cpu_count()),
        "GPUs": _gpus(),
        "C compiler": shutil.which(os.environ.get("CC", "gcc")) or "none (Kettle's CPU kernels are off)",
        **{variable: os.environ.get(variable, "(unset)") for variable in VARIABLES},
    }
    width = max(len(name) for name in rows)
    return "\n".join(f"{name:<{width}} : {value}" for name, value in rows.items())
