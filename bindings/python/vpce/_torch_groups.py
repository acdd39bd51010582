"""What tp_group means in vpce.torch: an explicit group's rank and size, and for
tp_group=None, Megatron's tensor-parallel group (through Megatron's parallel_state, when
Megatron has been imported and initialised), else one rank when torch.distributed is not
initialised or its default group has one rank; None with a default group of several ranks
and no Megatron is refused (tensor or data parallelism? vpce cannot tell)."""
from __future__ import annotations

import sys

import torch.distributed as dist


def _parallel_state():
    """Megatron's parallel_state when Megatron has been imported (it cannot be initialised
    otherwise, so vpce never imports Megatron itself); else None."""
    return sys.modules.get("megatron.core.parallel_state")


def _megatron_state():
    state = _parallel_state()
    if state is None:
        raise RuntimeError("megatron.core.parallel_state: expected Megatron to be imported and initialised, got "
                           "no Megatron")
    return state


def get_tensor_model_parallel_group(check_initialized=True):
    """Megatron's parallel_state.get_tensor_model_parallel_group."""
    return _megatron_state().get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_tensor_model_parallel_rank():
    """Megatron's parallel_state.get_tensor_model_parallel_rank."""
    return _megatron_state().get_tensor_model_parallel_rank()


def get_tensor_model_parallel_world_size():
    """Megatron's parallel_state.get_tensor_model_parallel_world_size."""
    return _megatron_state().get_tensor_model_parallel_world_size()


def _megatron_initialised():
    state = _parallel_state()
    try:
        return state is not None and bool(state.model_parallel_is_initialized())
    except (AssertionError, RuntimeError, AttributeError):
        return False


def _patchable_get_tensor_model_parallel_group():
    """get_tensor_model_parallel_group as vpce.torch has it at this call: code (and
    Megatron's own tests) that patches it on that module changes what tp_group=None means."""
    from . import torch as public_module  # noqa: PLC0415 (vpce.torch imports this module)

    return public_module.get_tensor_model_parallel_group()


def _default_group():
    """What tp_group=None means: Megatron's tensor-parallel group when Megatron is
    initialised, else None (one rank) when torch.distributed is not initialised or its
    default group has one rank. With a default group of several ranks and no Megatron, None
    is ambiguous (replicas of data parallelism, each with the whole vocabulary, would get
    the loss plus log R per token): ValueError, raised by each rank alone, with no
    collective, as Megatron raises when its group is not initialised."""
    if _megatron_initialised():
        return _patchable_get_tensor_model_parallel_group()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"tp_group: expected a process group, got None with torch.distributed's default group of "
                         f"{dist.get_world_size()} ranks and no Megatron tensor-parallel group (ambiguous): pass "
                         "torch.distributed.group.WORLD for tensor parallelism over every rank, or a group of one "
                         "rank (e.g. torch.distributed.new_group([rank]) on each rank) where each rank holds the "
                         "whole vocabulary (data parallelism)")
    return None


def _rank_and_size(group):
    """(rank, size) of an explicit group: a torch.distributed ProcessGroup, or any object
    with .rank() and .size() (Megatron's convention, get_pg_rank / get_pg_size)."""
    if hasattr(group, "rank") and hasattr(group, "size") and callable(group.size):
        return int(group.rank()), int(group.size())
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group=group), dist.get_world_size(group=group)
    raise TypeError(f"tp_group: expected a torch.distributed.ProcessGroup (or an object with .rank() and .size()), "
                    f"got {type(group).__name__}")


def _group(tp_group):
    """(group, rank, size): an explicit tp_group as given (one of size 1 needs nothing of
    torch.distributed), None as _default_group says; group None means one rank."""
    if tp_group is None:
        tp_group = _default_group()
        if tp_group is None:
            return None, 0, 1
    rank, size = _rank_and_size(tp_group)
    if size == 1:
        return None, 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"tp_group: expected an initialised torch.distributed for a group of {size} ranks, got "
                         "none initialised")
    if not 0 <= rank < size:
        raise ValueError(f"tp_group: expected a group this process belongs to, got rank {rank} of {size}")
    return tp_group, rank, size
