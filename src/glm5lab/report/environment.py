"""The machine and the libraries a report's numbers were measured with."""

from __future__ import annotations

import os
import platform
from importlib import metadata

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "matplotlib")


def environment() -> dict:
    """{python, platform, cpu, cpu_count, gpu, cuda, libraries: {name: version or None}}."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "gpu": gpu, "cuda": torch.version.cuda if gpu else None,
            "libraries": {name: _version(name) for name in LIBRARIES}}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
