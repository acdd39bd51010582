"""The forward's one all-gather on a process group, and the agreement on errors: one block
per rank of a size the group agrees on, a block header, then vpce's payload (or a rank's
error, when it failed before the gather), so that every rank raises the same error."""
from __future__ import annotations

import struct
import weakref

import torch
import torch.distributed as dist

from . import _vpce

# The forward's all-gather: one block per rank, [header][payload or its prefix][padding].
_BLOCK_HEADER = struct.Struct("<IIQd")  # magic, flags, payload bytes, legacy label smoothing
_BLOCK_MAGIC = 0x54435056  # "VPCT"
_FAILED = 1  # flags: this rank failed before the gather; its payload is "kind\nmessage" (higher bits: agree())
_MIN_CAPACITY = 4096  # bytes per block at first
_ERROR_KINDS = {"TypeError": TypeError, "ValueError": ValueError, "Error": _vpce.Error}


class _Blocks:
    """A group's block size and gather buffers. The size changes only as a function of
    gathered bytes, which every rank sees alike, so it stays the same on every rank."""

    def __init__(self):
        self.capacity = _MIN_CAPACITY
        self._send = self._recv = None

    def buffers(self, ranks):
        """(send [capacity], recv [ranks, capacity]) uint8, reused while the size holds."""
        if self._send is None or self._send.numel() != self.capacity:
            self._send = torch.empty(self.capacity, dtype=torch.uint8)
            self._recv = torch.empty(ranks, self.capacity, dtype=torch.uint8)
        return self._send, self._recv

    def fit(self, largest):
        """Grows the blocks for the largest payload any rank sent, or shrinks them when
        payloads have become much smaller (so small calls carry little padding)."""
        wanted = _BLOCK_HEADER.size + largest
        if wanted > self.capacity or wanted * 4 < self.capacity:
            self.capacity = max(_MIN_CAPACITY, wanted)


_GROUP_BLOCKS = weakref.WeakKeyDictionary()


def _blocks(group):
    if group not in _GROUP_BLOCKS:
        _GROUP_BLOCKS[group] = _Blocks()
    return _GROUP_BLOCKS[group]


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
    """This rank's side of the forward's one all-gather on a process group: the callable
    vpce hands its payload to, and the way in for a rank that failed before it, so that
    every rank decides from the same gathered blocks and raises the same error."""

    def __init__(self, group, rank, size):
        self.group, self.rank, self.size = group, rank, size
        self.legacy_smoothing = 0.0  # sent in the block header, so that ranks must agree on it
        self.agreements = []  # (what, bool) the ranks must agree on: the header's flags, from bit 1
        self.joined = False
        self.error = None  # the group's error, once the gathered blocks show one

    def agree(self, what, value):
        """Makes `value` (a bool) part of the gather's agreement: ranks that differ on it all
        raise the same disagreement, before anything later can wait on a collective that
        only some of them make. Every rank calls it alike (the same code path)."""
        self.agreements.append((what, bool(value)))

    def _agreed_flags(self):
        return sum(int(value) << (i + 1) for i, (_, value) in enumerate(self.agreements))

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
        blocks = _blocks(self.group)
        capacity = blocks.capacity
        gathered = self._exchange(blocks, flags, payload)
        headers = [_BLOCK_HEADER.unpack(bytes(gathered[r, :_BLOCK_HEADER.size].tolist())) for r in range(self.size)]
        self.error = self._group_error(headers, gathered)
        sizes = [header[2] for header in headers]
        blocks.fit(max(sizes))
        if self.error is None and len(set(sizes)) == 1 and _BLOCK_HEADER.size + sizes[0] > capacity:
            gathered = self._exchange(blocks, flags, payload)  # every rank's payload outgrew the blocks
        return sizes, gathered

    def _exchange(self, blocks, flags, payload):
        send, recv = blocks.buffers(self.size)
        header = _BLOCK_HEADER.pack(_BLOCK_MAGIC, flags | self._agreed_flags(), payload.numel(), self.legacy_smoothing)
        send[:_BLOCK_HEADER.size] = torch.tensor(list(header), dtype=torch.uint8)
        kept = min(payload.numel(), blocks.capacity - _BLOCK_HEADER.size)
        send[_BLOCK_HEADER.size:_BLOCK_HEADER.size + kept] = payload[:kept]
        dist.all_gather(list(recv.unbind(0)), send, group=self.group)
        return recv

    def _group_error(self, headers, gathered):
        """The error the gathered blocks show, the same on every rank; None when there is none."""
        for r, (magic, _, _, _) in enumerate(headers):
            if magic != _BLOCK_MAGIC:
                return _vpce.Error(f"invalid usage: all_gather: expected vpce.torch's block from rank {r}, got "
                                   "something else (another collective on tp_group, or another vpce version?)")
        for r, (_, flags, size, _) in enumerate(headers):
            if flags & _FAILED:
                end = _BLOCK_HEADER.size + min(size, gathered.shape[1] - _BLOCK_HEADER.size)
                message = bytes(gathered[r, _BLOCK_HEADER.size:end].tolist()).decode(errors="replace")
                kind, _, text = message.partition("\n")
                return _ERROR_KINDS.get(kind, _vpce.Error)(f"rank {r} of {self.size}: {text}")
        for r, (_, flags, _, _) in enumerate(headers):
            for i, (what, _) in enumerate(self.agreements):
                first, mine = bool(headers[0][1] >> (i + 1) & 1), bool(flags >> (i + 1) & 1)
                if mine != first:
                    return _vpce.Error(f"invalid usage: ranks disagree on {what}: expected rank 0's {first} on "
                                       f"every rank, got {mine} on rank {r}")
        first = headers[0][3]
        for r, (_, _, _, smoothing) in enumerate(headers):
            if smoothing != first:
                return _vpce.Error(f"invalid usage: ranks disagree on label_smoothing (with "
                                   f"megatron_legacy_label_smoothing): expected rank 0's {first} on every rank, got "
                                   f"{smoothing} on rank {r}")
        return None
