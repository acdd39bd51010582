"""vpce's Python package on one rank: vpce.torch against PyTorch's float64 F.cross_entropy,
gradcheck, bf16, in place, the loss options and errors."""
import pytest
import torch

import vpce
import vpce.torch as vt
from reference import loss_and_grad, relative_error

torch.manual_seed(0)


def problem(shape=(7, 3), vocab=501, dtype=torch.float32, scale=3.0):
    logits = (torch.randn(*shape, vocab, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, vocab, shape)
    grad_loss = torch.rand(shape, dtype=torch.float32) + 0.5
    return logits, target, grad_loss


def run(logits, target, grad_loss, *args, **kwargs):
    x = logits.clone().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(x, target, *args, **kwargs)
    loss.backward(grad_loss)
    return loss.detach(), x.grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fp32_matches_float64_reference(label_smoothing):
    logits, target, grad_loss = problem()
    loss, grad = run(logits, target, grad_loss, label_smoothing)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=label_smoothing)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def test_bf16_within_bf16_rounding():
    logits, target, grad_loss = problem(dtype=torch.bfloat16)
    loss, grad = run(logits, target, grad_loss, 0.1)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=0.1)
    assert grad.dtype == torch.bfloat16
    assert relative_error(loss, want_loss) < 1e-6  # the math is fp32 on the bf16 values
    # Each gradient element is rounded once to bf16: within half an ulp (2^-9 relative).
    assert ((grad.double() - want_grad).abs() <= want_grad.abs() * 2.0**-8 + 1e-30).all()


def test_large_new_gradient_on_huge_pages_matches_reference():
    # 64 MiB of fp32 logits: the backward's new gradient is advised onto huge pages first.
    logits, target, grad_loss = problem(shape=(512,), vocab=32768, scale=2.0)
    loss, grad = run(logits, target, grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def test_advise_huge_pages_is_only_a_hint():
    buffer = torch.empty(4 << 20, dtype=torch.uint8)
    assert vpce._vpce.advise_huge_pages(buffer.data_ptr(), 4096) is False  # no whole 2 MiB page inside
    assert isinstance(vpce._vpce.advise_huge_pages(buffer.data_ptr(), buffer.numel()), bool)
    buffer.fill_(7)  # still ordinary, writable memory
    assert int(buffer.sum()) == 7 * buffer.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_place_equals_out_of_place(dtype):
    logits, target, grad_loss = problem(dtype=dtype)
    loss, grad = run(logits, target, grad_loss, 0.1)
    x = logits.clone().requires_grad_()
    y = x * 1  # a non-leaf whose buffer the backward may overwrite
    loss_in_place = vt.vocab_parallel_cross_entropy(y, target, 0.1, inplace_backward=True)
    loss_in_place.backward(grad_loss)
    assert torch.equal(loss, loss_in_place.detach())
    assert torch.equal(grad, x.grad)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_gradcheck_float64(label_smoothing):
    # vpce computes in fp32 for every dtype, so the finite differences use a step of 1e-2
    # (fp32 rounding over a smaller step would swamp them) and tolerances to match.
    x = torch.randn(4, 2, 30, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 30, (4, 2))
    assert torch.autograd.gradcheck(lambda t: vt.vocab_parallel_cross_entropy(t, y, label_smoothing), (x,),
                                    eps=1e-2, atol=1e-4, rtol=1e-3)
    assert torch.autograd.gradcheck(
        lambda t: vt.vocab_parallel_cross_entropy(t, y, label_smoothing, z_loss_weight=0.01, softcap=5.0,
                                                  logit_scale=0.7), (x,), eps=1e-2, atol=1e-4, rtol=1e-3)


def test_pytorch_semantics_and_ignore_index():
    logits, target, grad_loss = problem()
    target[0, :] = -100
    target[3, 1] = -100
    loss, grad = run(logits, target, grad_loss, 0.2, smoothing_semantics="pytorch")
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=0.2, semantics="pytorch")
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6
    assert (loss[0] == 0).all() and (grad[0] == 0).all()


def test_every_token_ignored_is_zero_not_nan():
    logits, target, grad_loss = problem()
    target.fill_(-100)
    loss, grad = run(logits, target, grad_loss)
    assert (loss == 0).all() and (grad == 0).all()


def test_z_loss_softcap_scale_padding_against_formulas():
    logits, target, grad_loss = problem(vocab=300)
    target %= 290
    scale, cap, w = 0.5, 20.0, 1e-3
    loss, grad = run(logits, target, grad_loss, z_loss_weight=w, logit_scale=scale, softcap=cap, valid_vocab_size=290)
    x = logits.double().requires_grad_()
    z = cap * torch.tanh(x[..., :290] * scale / cap)
    lse = torch.logsumexp(z, dim=-1)
    want = torch.nn.functional.cross_entropy(z.reshape(-1, 290), target.reshape(-1), reduction="none").view(
        target.shape) + w * lse**2
    (want_grad,) = torch.autograd.grad(want, x, grad_loss.double())
    assert relative_error(loss, want.detach()) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def test_strided_and_transposed_inputs():
    logits, target, grad_loss = problem(shape=(6, 4), vocab=200)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    # A [b, s, V] buffer seen as [s, b, V] (not rows of one stride: vpce.torch copies it).
    transposed = logits.transpose(0, 1).contiguous().transpose(0, 1)
    loss, grad = run(transposed, target, grad_loss)
    assert relative_error(loss, want_loss) < 1e-6 and relative_error(grad, want_grad) < 1e-6
    # A column slice of a wider buffer: read in place through its row stride.
    wide = torch.cat([logits, torch.zeros(6, 4, 7)], dim=-1)[..., :200]
    loss, grad = run(wide, target, grad_loss)
    assert relative_error(loss, want_loss) < 1e-6 and relative_error(grad, want_grad) < 1e-6


def test_unfused_cross_entropy_is_the_plain_loss():
    logits, target, grad_loss = problem()
    assert torch.equal(vt.unfused_cross_entropy(logits, target), vt.vocab_parallel_cross_entropy(logits, target))


def test_errors_name_the_argument():
    logits, target, _ = problem(vocab=50)
    with pytest.raises(vpce.Error, match=r"targets: expected values in \[0, 50\)"):
        vt.vocab_parallel_cross_entropy(logits, target + 50)
    with pytest.raises(vpce.Error, match="label_smoothing"):
        vt.vocab_parallel_cross_entropy(logits, target % 50, 1.5)
    with pytest.raises(TypeError, match="unexpected options"):
        vt.vocab_parallel_cross_entropy(logits, target % 50, colour="red")
    with pytest.raises(ValueError, match="smoothing_semantics"):
        vt.vocab_parallel_cross_entropy(logits, target % 50, 0.1, smoothing_semantics="nemo")
    with pytest.raises(vpce.Error, match="targets.shape"):
        vt.vocab_parallel_cross_entropy(logits, target[:2] % 50)


def test_group_of_several_ranks_needs_a_collective():
    logits, target, _ = problem(vocab=10)
    loss = torch.empty(target.shape)
    with pytest.raises(vpce.Error, match="all_gather: expected a callable"):
        vpce.forward(logits, target, 0, 10, 20, vpce.LossOptions(), loss, torch.empty(target.shape), rank=0, size=2)
