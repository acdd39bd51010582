"""vpce's all-gathers on a process group, and the agreement on errors.

Every gather vpce.torch makes on a group carries one block per rank: a block header (which
gather this is, the flags the ranks must agree on, the payload's size), then vpce's payload
or its prefix (or this rank's error, when it failed before the gather). So ranks that
disagree (on an argument, on which gather they are in, on their payloads) and a rank that
failed all raise the same error at that gather. The blocks' size is computed alike on every
rank from the gathers every rank has seen, never from this rank's own arguments: a gather
whose ranks sent blocks of different sizes would pair them wrongly (gloo aborts the process).

One call at a time per group in a process: the ranks' collectives are paired by the order
in which they are issued, so a call of one thread could pair with another thread's call on
the other ranks. A call holds its group's lock for its collectives; a call that finds the
group in use by another thread waits for it, then marks its blocks, and every rank of that
gather raises the same error instead of returning a loss."""
from __future__ import annotations

import contextlib
import struct
import threading
import weakref

import torch
import torch.distributed as dist

from . import _vpce

# One block per rank: [header][payload or its prefix][padding].
_BLOCK_HEADER = struct.Struct("<IIIIIQ")  # magic, kind, flags, agreed mask, agreed values, payload bytes
_BLOCK_MAGIC = 0x54435056  # "VPCT"
_MIN_CAPACITY = 4096  # bytes per block at first
# flags
_FAILED = 1  # this rank failed before the gather; its payload is "kind\nmessage"
_CONCURRENT = 2  # this rank's call waited for another thread's call on the same group
# What a gather carries (kinds): what the error names when ranks are in different gathers.
_LOSS_STATISTICS = 1
_HIDDEN_STATES = 2
_KINDS = {_LOSS_STATISTICS: "the loss's statistics", _HIDDEN_STATES: "the sequence-parallel hidden states"}
# The flags the ranks must agree on, each at a fixed bit of the agreed mask and values, so
# that gathers of different kinds still compare them (sequence_parallel decides which
# gather comes first).
_HIDDEN_GRADIENT = "whether hidden's gradient is wanted (hidden.requires_grad under grad mode)"
_AGREED = ("megatron_legacy_label_smoothing", "sequence_parallel", _HIDDEN_GRADIENT)
_ERROR_KINDS = {"TypeError": TypeError, "ValueError": ValueError, "Error": _vpce.Error}


class _GroupState:
    """A group's gathers in this process: the lock a call holds for its collectives, and
    the block size. That size is predicted from the kind of the group's last gather (the
    size the gather after one of that kind took, learnt from what every rank sent; the last
    gather's size when none is known yet), so a step that repeats its gathers (the hidden
    states, then the loss's statistics) sizes each right after its first time, and every
    rank computes the same size for any gather, whatever its own arguments."""

    def __init__(self):
        self.lock = threading.Lock()
        self.previous = None  # kind of the last gather every rank agreed on; None at first or after an error
        self._capacity_after = {}  # previous kind -> block bytes of the next gather
        self._last = _MIN_CAPACITY  # block bytes of the last gather
        self._buffers = {}  # block bytes -> (send, recv), the last few sizes used

    def capacity(self):
        return self._capacity_after.get(self.previous, self._last)

    def buffers(self, ranks, capacity):
        """(send [capacity], recv [ranks, capacity]) uint8, kept for reuse."""
        pair = self._buffers.get(capacity)
        if pair is None or pair[1].shape[0] != ranks:
            if len(self._buffers) >= 4:
                self._buffers.pop(next(iter(self._buffers)))
            pair = self._buffers[capacity] = (torch.empty(capacity, dtype=torch.uint8),
                                              torch.empty(ranks, capacity, dtype=torch.uint8))
        return pair

    def learn(self, largest):
        """Sizes the blocks of this gather's position for the largest payload any rank sent:
        grown to fit it, or shrunk when payloads have become much smaller."""
        wanted = _BLOCK_HEADER.size + largest
        capacity = self.capacity()
        if wanted > capacity or wanted * 4 < capacity:
            self._capacity_after[self.previous] = max(_MIN_CAPACITY, wanted)

    def done(self, kind, capacity):
        """A gather of `kind` in blocks of `capacity` bytes that every rank agreed on."""
        self.previous, self._last = kind, capacity


_STATES = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state(group):
    with _STATES_LOCK:
        state = _STATES.get(group)
        if state is None:
            state = _STATES[group] = _GroupState()
        return state


class _GroupCall:
    """One call's collectives on a group in this process (a context manager): holds the
    group's lock while they run, and notes whether the call had to wait for another
    thread's call (`concurrent`), which its gathers then tell every rank."""

    def __init__(self, group):
        self.group, self.state = group, _state(group)
        self.concurrent = False

    def __enter__(self):
        if not self.state.lock.acquire(blocking=False):
            self.concurrent = True
            self.state.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.state.lock.release()


def _calling(group, size):
    """A call's context on its group: a _GroupCall for a group of more than one rank, else
    none (None)."""
    return _GroupCall(group) if size > 1 else contextlib.nullcontext()


def _error_kind(error):
    """(kind, text) of an exception, for a failure block: TypeError and ValueError keep
    their class, anything else becomes vpce.Error."""
    if isinstance(error, _vpce.Error):
        return "Error", str(error)
    for kind in ("TypeError", "ValueError"):
        if isinstance(error, _ERROR_KINDS[kind]):
            return kind, str(error)
    return "Error", f"{type(error).__name__}: {error}"


class _Collective:
    """This rank's side of one of a call's gathers on a process group (by default the
    loss's statistics): the callable vpce hands its payload to, and the way in for a rank
    that failed before it, so that every rank decides from the same gathered blocks and
    raises the same error."""

    kind = _LOSS_STATISTICS

    def __init__(self, call, rank, size):
        self.call, self.rank, self.size = call, rank, size
        self.agreed_mask = self.agreed_values = 0
        self.joined = False
        self.error = None  # the group's error, once the gathered blocks show one

    def agree(self, name, value):
        """Makes `value` (a bool) of `name` (one of _AGREED) part of the gather's agreement:
        ranks that differ on it all raise the same disagreement, before anything later can
        wait on a collective that only some of them make."""
        bit = 1 << _AGREED.index(name)
        self.agreed_mask |= bit
        self.agreed_values = self.agreed_values | bit if value else self.agreed_values & ~bit

    def __call__(self, send, recv):
        """vpce's all_gather(send, recv): every rank's payload into recv, rank 0's first."""
        payload = torch.frombuffer(send, dtype=torch.uint8)
        sizes, blocks = self._gather(0, payload)
        if self.error is not None:
            raise self.error
        own = payload.numel()
        out = torch.frombuffer(recv, dtype=torch.uint8).view(self.size, own)
        room = blocks.shape[1] - _BLOCK_HEADER.size
        for r, size in enumerate(sizes):
            # Sizes that disagree (a different number of tokens) leave each rank a prefix of
            # the others' payloads, with their vpce headers: vpce then reports the disagreement.
            kept = min(own, size, room)
            out[r, :kept] = blocks[r, _BLOCK_HEADER.size:_BLOCK_HEADER.size + kept]
            out[r, kept:] = 0

    def agreed(self, error):
        """The error this rank raises for `error`: the group's when the gather showed one;
        else, when this rank has not joined the gather yet, the one every rank learns by
        its joining with `error`; else `error` itself (vpce's own, the same on every rank)."""
        if self.error is None and not self.joined:
            kind, text = _error_kind(error)
            self._gather(_FAILED, torch.tensor(list(f"{kind}\n{text}".encode()), dtype=torch.uint8))
        return self.error if self.error is not None else error

    def _gather(self, flags, payload):
        """Gathers this rank's block; (every rank's payload size, the gathered blocks), and
        self.error set when the blocks show a failure or a disagreement."""
        self.joined = True
        state = self.call.state
        capacity = state.capacity()
        gathered = self._exchange(capacity, flags, payload)
        headers = [_BLOCK_HEADER.unpack(bytes(gathered[r, :_BLOCK_HEADER.size].tolist())) for r in range(self.size)]
        self.error = self._group_error(headers, gathered)
        if self.error is not None:
            state.previous = None  # every rank starts again from the same state
            return [header[5] for header in headers], gathered
        sizes = [header[5] for header in headers]
        state.learn(max(sizes))
        if len(set(sizes)) == 1 and _BLOCK_HEADER.size + sizes[0] > capacity:
            capacity = state.capacity()
            gathered = self._exchange(capacity, flags, payload)  # every payload outgrew the blocks
        state.done(self.kind, capacity)
        return sizes, gathered

    def _exchange(self, capacity, flags, payload):
        send, recv = self.call.state.buffers(self.size, capacity)
        if self.call.concurrent:
            flags |= _CONCURRENT
        header = _BLOCK_HEADER.pack(_BLOCK_MAGIC, self.kind, flags, self.agreed_mask, self.agreed_values,
                                    payload.numel())
        send[:_BLOCK_HEADER.size] = torch.tensor(list(header), dtype=torch.uint8)
        kept = min(payload.numel(), capacity - _BLOCK_HEADER.size)
        send[_BLOCK_HEADER.size:_BLOCK_HEADER.size + kept] = payload[:kept]
        dist.all_gather(list(recv.unbind(0)), send, group=self.call.group)
        return recv

    def _group_error(self, headers, gathered):
        """The error the gathered blocks show, the same on every rank (it depends on the
        blocks alone); None when there is none."""
        for r, header in enumerate(headers):
            if header[0] != _BLOCK_MAGIC:
                return _vpce.Error(f"invalid usage: all_gather: expected vpce.torch's block from rank {r}, got "
                                   "something else (another collective on tp_group, or another vpce version?)")
        for r, header in enumerate(headers):
            if header[2] & _CONCURRENT:
                return _vpce.Error(f"invalid usage: tp_group: expected one vpce call at a time on a group in a "
                                   f"process, got a call on rank {r} while another thread's call on the same group "
                                   "was in progress (the ranks' collectives are paired by the order they are "
                                   "issued, so calls from several threads can pair with other threads' calls): "
                                   "call vpce on a group from one thread, or give each thread its own group")
        for r, header in enumerate(headers):
            for i, name in enumerate(_AGREED):
                bit = 1 << i
                if headers[0][3] & header[3] & bit and (headers[0][4] & bit) != (header[4] & bit):
                    return _vpce.Error(f"invalid usage: ranks disagree on {name}: expected rank 0's "
                                       f"{bool(headers[0][4] & bit)} on every rank, got {bool(header[4] & bit)} on "
                                       f"rank {r}")
        for r, header in enumerate(headers):
            if header[1] != headers[0][1]:
                return _vpce.Error(f"invalid usage: ranks disagree on which collective this is: rank 0 gathers "
                                   f"{_KINDS.get(headers[0][1], 'something else')}, rank {r} "
                                   f"{_KINDS.get(header[1], 'something else')} (the same vpce call, with the same "
                                   "arguments, is expected on every rank of tp_group)")
        for r, header in enumerate(headers):
            if header[2] & _FAILED:
                end = _BLOCK_HEADER.size + min(header[5], gathered.shape[1] - _BLOCK_HEADER.size)
                message = bytes(gathered[r, _BLOCK_HEADER.size:end].tolist()).decode(errors="replace")
                kind, _, text = message.partition("\n")
                return _ERROR_KINDS.get(kind, _vpce.Error)(f"rank {r} of {self.size}: {text}")
        return None
