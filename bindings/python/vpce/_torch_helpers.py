"""Megatron's VocabParallelCrossEntropy static helpers, each with Megatron's signature and
effects: on vpce's SIMD row kernels for dense CPU tensors outside autograd recording and
torch.compile, Megatron's torch operations anywhere else."""
from __future__ import annotations

from typing import Tuple

import torch

from . import _vpce
from ._torch_compile import _compiling


class VocabParallelCrossEntropy:
    """Computes the Cross Entropy Loss splitting the Vocab size across tensor parallel ranks.
    This implementation is used in both fused and unfused cross entropy implementations.

    Megatron's static helpers, each with Megatron's signature, in-place effects, return
    values, shapes and dtypes. On CPU tensors (dense rows, outside autograd recording and
    torch.compile) the max and the exponential run on vpce's SIMD row kernels (vpce/rows.h):
    the max widening bf16/fp16 to float32 in the same read, exp(x - max) in place in one
    pass (no separate subtraction); within 1 ulp of torch's. Anywhere else, and for
    everything else, they are Megatron's torch operations."""

    @staticmethod
    def calculate_logits_max(vocab_parallel_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Calculates logits_max: (the logits as float32, the same tensor when they are
        float32 already, a new one otherwise; their max over the last dimension, float32)."""
        x = vocab_parallel_logits
        if _row_kernel_fits(x, (torch.float32, torch.bfloat16, torch.float16)):
            logits_max = torch.empty(x.shape[:-1], dtype=torch.float32)
            if x.dtype == torch.float32:
                _vpce.row_max(x, logits_max)
                return x, logits_max
            widened = torch.empty(x.shape, dtype=torch.float32)
            _vpce.row_max(x, logits_max, widened)
            return widened, logits_max
        vocab_parallel_logits = vocab_parallel_logits.float()
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        return vocab_parallel_logits, logits_max

    @staticmethod
    def gather_predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor,
                                vocab_start_index: int, vocab_end_index: int
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read-only part of the forward: (target_mask, masked_target_1d,
        predicted_logits): the mask of targets outside [vocab_start_index,
        vocab_end_index), the local target ids flattened (0 where masked), and
        logits[target] - logits_max with target's shape (0 where masked). Does not modify
        vocab_parallel_logits."""
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        logits_2d = vocab_parallel_logits.reshape(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d] - logits_max.reshape(-1)
        predicted_logits = predicted_logits_1d.contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        return target_mask, masked_target_1d, predicted_logits

    @staticmethod
    def exp_logits_inplace(vocab_parallel_logits: torch.Tensor, logits_max: torch.Tensor) -> None:
        """In place: vocab_parallel_logits <- exp(vocab_parallel_logits - logits_max).
        Pointwise only; returns None."""
        if _row_kernel_fits(vocab_parallel_logits, (torch.float32,)) and _shift_fits(logits_max, vocab_parallel_logits):
            _vpce.exp_rows_in_place(vocab_parallel_logits, logits_max)
            return
        vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
        torch.exp(vocab_parallel_logits, out=vocab_parallel_logits)

    @staticmethod
    def calculate_predicted_logits(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                   logits_max: torch.Tensor, vocab_start_index: int, vocab_end_index: int
                                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Calculates predicted logits: (target_mask, masked_target_1d, predicted_logits,
        sum_exp_logits, exp_logits). vocab_parallel_logits is overwritten in place with
        exp(logits - logits_max) and returned as exp_logits."""
        x = vocab_parallel_logits
        # The target's logit - max first (the same bits as Megatron's in-place shift, then
        # its read: one rounding either way), then the exponentials in place.
        target_mask, masked_target_1d, predicted_logits = VocabParallelCrossEntropy.gather_predicted_logits(
            x, target, logits_max, vocab_start_index, vocab_end_index)
        # In the logits' dtype, as Megatron's shift in place leaves it (bf16 logits with a float32
        # max: the difference rounded to bf16; a float64 max: float32 logits stay float32).
        predicted_logits = predicted_logits.to(x.dtype)
        if _row_kernel_fits(x, (torch.float32,)) and _shift_fits(logits_max, x) and target.shape == x.shape[:-1]:
            # The sums as torch sums them (Megatron's order), so that they agree within an ulp:
            # the kernel's one-pass sums accumulate in float32 within a chunk, up to 3.5 ulps
            # from exact at K = 1200 where torch's are 2.6 (docs/performance.md).
            _vpce.exp_rows_in_place(x, logits_max)
        else:
            x -= logits_max.unsqueeze(dim=-1)
            torch.exp(x, out=x)
        sum_exp_logits = x.sum(dim=-1)
        exp_logits = x
        return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits

    @staticmethod
    def calculate_cross_entropy_loss(exp_logits: torch.Tensor, predicted_logits: torch.Tensor,
                                     sum_exp_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Calculates cross entropy loss: (exp_logits divided in place by sum_exp_logits,
        so the softmax, the same tensor; log(sum_exp_logits) - predicted_logits)."""
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        return exp_logits, loss

    @staticmethod
    def prepare_gradient_calculation_operands(softmax: torch.Tensor, target_mask: torch.Tensor
                                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prepare gradient calculation operands: (grad_2d, a [N, K] view of softmax;
        arange_1d; softmax_update = 1 - target_mask as float32; grad_input, softmax itself)."""
        grad_input = softmax
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        return grad_2d, arange_1d, softmax_update, grad_input

    @staticmethod
    def scale_gradients_inplace(grad_input: torch.Tensor, grad_output: torch.Tensor) -> None:
        """In place: grad_input <- grad_input * grad_output (per row). Pointwise only;
        returns None."""
        grad_input.mul_(grad_output.unsqueeze(dim=-1))

    @staticmethod
    def calculate_gradients(grad_2d: torch.Tensor, arange_1d: torch.Tensor, masked_target_1d: torch.Tensor,
                            softmax_update: torch.Tensor, grad_input: torch.Tensor, grad_output: torch.Tensor
                            ) -> torch.Tensor:
        """Calculates gradients in place in grad_input (grad_2d is a view of it): subtracts
        softmax_update at each row's target, scales rows by grad_output; returns grad_input."""
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input


def _row_kernel_fits(x, dtypes):
    """Whether vpce's row kernels take x: a contiguous CPU tensor of one of `dtypes` with at
    least one dimension and a non-empty last one, outside torch.compile and autograd
    recording (anything else gets Megatron's torch operations)."""
    return (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in dtypes and x.dim() >= 1
            and x.shape[-1] > 0 and x.is_contiguous() and x.layout == torch.strided
            and not (x.requires_grad and torch.is_grad_enabled()) and not _compiling())


def _shift_fits(shift, x):
    """A per-row float32 shift of shape x.shape[:-1], contiguous on the CPU."""
    return (isinstance(shift, torch.Tensor) and shift.dtype == torch.float32 and shift.device.type == "cpu"
            and shift.shape == x.shape[:-1] and shift.is_contiguous()
            and not (shift.requires_grad and torch.is_grad_enabled()))
