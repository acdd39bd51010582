"""torch.compile and torch.library as vpce.torch meets them: whether this PyTorch has
torch.library custom ops (>= 2.4), whether torch.compile is tracing now, and a function
whose result torch.compile takes as a constant of the graph."""
from __future__ import annotations

import torch

_CUSTOM_OPS = hasattr(torch, "library") and hasattr(torch.library, "custom_op") and hasattr(
    torch.library, "register_autograd")


def _compiling():
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    dynamo = getattr(torch, "_dynamo", None)
    return bool(dynamo is not None and hasattr(dynamo, "is_compiling") and dynamo.is_compiling())


def _constant(function):
    """Called once while torch.compile traces, its result a constant of the graph."""
    dynamo = getattr(torch, "_dynamo", None) if _CUSTOM_OPS else None
    return dynamo.assume_constant_result(function) if dynamo is not None else function
