"""Checks of user input, one rule each, one message form: `NAME = VALUE is not allowed: RULE`.

`ConfigError` is the error of a config field (`glm5lab.config`); the other checks raise
ValueError unless told otherwise. Used by the config, its HF form, the CLI, the inference and
evaluation entry points, so a rule and its wording live here once.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A config value is out of its allowed range; the message names field, value and the rule."""


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def refuse(name: str, value, allowed: str, error: type[Exception] = ValueError):
    """Raise `error` with the one message form."""
    raise error(f"{name} = {value!r} is not allowed: {allowed}")


def int_at_least(name: str, value, lo: int, *, error: type[Exception] = ValueError) -> int:
    """`value` when it is an int >= lo (a bool or an integral float is refused, with a hint)."""
    if not is_int(value) or value < lo:
        hint = f" (write {int(value)}, not {value})" if isinstance(value, float) and value.is_integer() else ""
        refuse(name, value, f"an integer >= {lo}{hint}", error)
    return value


def finite(name: str, value, *, positive: bool = False, error: type[Exception] = ValueError) -> float:
    """float(value) when it is a finite number >= 0 (> 0 with `positive`; not a bool)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        refuse(name, value, f"a finite number {'> 0' if positive else '>= 0'}", error)
    return float(value)


def fraction(name: str, value) -> float:
    """float(value) when it is a number in (0, 1] (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        refuse(name, value, "a number in (0, 1]")
    return float(value)


def one_of(name: str, value, allowed, *, error: type[Exception] = ValueError):
    """`value` when it is one of `allowed`."""
    if value not in allowed:
        refuse(name, value, f"one of {tuple(allowed)}", error)
    return value


DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2), "fp8": ("float8_e4m3fn", 1)}
"""glm5lab's element types: short name -> (torch dtype name, bytes per value). The ledger counts
bytes in any of them; the models run in "fp32" or "bf16" (CPU: fp32, no bf16 units on the
project's machines; CUDA: bf16, `default_dtype`)."""
TORCH_NAMES = {torch_name: name for name, (torch_name, _) in DTYPES.items()}


def dtype_name(name: str, allowed=tuple(DTYPES)) -> str:
    """The short name of `name` (a short name, or a torch name such as "bfloat16"), one of `allowed`."""
    short = TORCH_NAMES.get(name, name)
    if short not in allowed:
        refuse("dtype", name, f"one of {', '.join(allowed)}")
    return short


def dtype_bytes(name: str) -> int:
    """Bytes per value of a short or torch dtype name (`DTYPES`); ValueError for another name."""
    return DTYPES[dtype_name(name)][1]


def torch_dtype(name: str):
    """The torch.dtype of a short or torch dtype name (fp32/bf16 or float32/bfloat16)."""
    import torch

    return getattr(torch, DTYPES[dtype_name(name, ("fp32", "bf16"))][0])


def torch_device(value, name: str = "device"):
    """The torch.device `value` names ("cpu", "cuda", "cuda:N"); None or "auto": cuda when available, else cpu.
    Raises ValueError naming `name` (the caller's argument) for a name torch does not know, or for CUDA where
    this torch build or machine has none."""
    import torch

    if value in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        refuse(name, value, "'auto', 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {value}: no CUDA device is available (this torch build or machine has none); "
                         f"use {name} cpu")
    return device


def default_dtype(device) -> str:
    """The models' dtype on `device`: "bf16" on CUDA, else "fp32"."""
    return "bf16" if str(device).startswith("cuda") else "fp32"
