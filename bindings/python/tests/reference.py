"""The float64 PyTorch references the vpce tests compare against (written from PyTorch's own
F.cross_entropy and from Megatron-LM's published formulas, not from vpce)."""
import torch
import torch.nn.functional as F


def cross_entropy(logits, target, label_smoothing=0.0, semantics="megatron", ignore_index=-100):
    """Per-token loss of [..., V] logits in float64 and its gradient function.

    Megatron's smoothing (target 1 - a, others a / (V - 1)) is PyTorch's with
    a' = a V / (V - 1)."""
    vocab = logits.shape[-1]
    a = label_smoothing * vocab / (vocab - 1) if semantics == "megatron" else label_smoothing
    full = logits.detach().double().reshape(-1, vocab).requires_grad_()
    loss = F.cross_entropy(full, target.reshape(-1), reduction="none", label_smoothing=a,
                           ignore_index=ignore_index)
    return loss.view(target.shape), full


def loss_and_grad(logits, target, grad_loss, **kwargs):
    """(loss [target.shape], gradient [..., V]) in float64."""
    loss, full = cross_entropy(logits, target, **kwargs)
    (grad,) = torch.autograd.grad(loss, full, grad_loss.double().reshape(loss.shape))
    return loss.detach(), grad.view(logits.shape)


def megatron_legacy(full_logits, target, vocab_begin, vocab_end, grad_loss, label_smoothing):
    """Megatron-LM's loss with label smoothing as the rank holding columns
    [vocab_begin, vocab_end) computes it (with its shard's size K and its shard's mean
    log-probability, from megatron/core/tensor_parallel/cross_entropy.py), and that rank's
    gradient, in float64: (loss [target.shape], gradient [..., K])."""
    vocab = full_logits.shape[-1]
    z = full_logits.detach().double().reshape(-1, vocab)
    t = target.reshape(-1)
    g = grad_loss.double().reshape(-1)
    lse = torch.logsumexp(z, dim=-1)
    shard = z[:, vocab_begin:vocab_end]
    k = vocab_end - vocab_begin
    s = label_smoothing * k / (k - 1)
    log_probs = shard - lse.unsqueeze(-1)
    loss = (1.0 - s) * (lse - z[torch.arange(z.shape[0]), t]) - s * log_probs.mean(dim=-1)
    grad = log_probs.exp()
    owned = (t >= vocab_begin) & (t < vocab_end)
    rows = torch.nonzero(owned).squeeze(-1)
    grad[rows, t[rows] - vocab_begin] -= 1.0 - s
    grad -= s / k
    grad *= g.unsqueeze(-1)
    return loss.view(target.shape), grad.view(*target.shape, k)


def relative_error(actual, expected):
    actual = actual.double()
    expected = expected.double()
    scale = expected.abs().max().item()
    difference = (actual - expected).abs().max().item()
    return difference / scale if scale > 0 else difference
