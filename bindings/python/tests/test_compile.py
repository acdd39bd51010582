"""vpce.torch under torch.compile (PyTorch >= 2.4): the loss is a torch.library custom op
(vpce::cross_entropy_forward, vpce::cross_entropy_backward) with fake implementations and
registered autograd, so a training step that contains it compiles with fullgraph=True, 0
graph breaks (torch._dynamo.explain), under the default inductor backend, and gives the
float64 reference's loss and gradient; torch.library.opcheck passes on both ops. PyTorch
1.13 has no torch.library.custom_op: these tests skip there (vpce uses its
autograd.Function)."""
import pytest
import torch

pytest.importorskip("torch._library.custom_ops", reason="torch.library.custom_op needs PyTorch >= 2.4")

import vpce.torch as vt  # noqa: E402
from reference import loss_and_grad, relative_error  # noqa: E402


def problem(vocab=96, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 2, 16, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, 16, generator=generator, dtype=torch.float64) * 0.5).to(dtype)
    target = torch.randint(0, vocab, (4, 2), generator=generator)
    return hidden, weight, target


def step(hidden, weight, target, **kwargs):
    """A training step's end: the LM head, vpce's loss, its mean, the backward."""
    logits = hidden @ weight.t()
    loss = vt.vocab_parallel_cross_entropy(logits, target, 0.1, **kwargs)
    return loss.mean()


def reference(hidden, weight, target):
    logits = (hidden.double() @ weight.double().t()).detach().requires_grad_()
    want_loss, want_grad = loss_and_grad(logits, target, torch.full((4, 2), 1 / 8), label_smoothing=0.1)
    return want_loss.mean(), (want_grad.reshape(8, -1).t() @ hidden.double().reshape(8, 16))


def test_registered_ops():
    assert hasattr(torch.ops.vpce, "cross_entropy_forward") and hasattr(torch.ops.vpce, "cross_entropy_backward")


@pytest.mark.parametrize("kwargs", [{}, {"inplace_backward": True}, {"z_loss_weight": 1e-3}],
                         ids=["plain", "inplace flag", "an option"])
def test_a_step_traces_with_no_graph_break(kwargs):
    hidden, weight, target = problem()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(hidden, weight.requires_grad_(), target, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_fullgraph_inductor_matches_eager_and_the_reference():
    hidden, weight, target = problem()
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # the default backend: inductor
    w = weight.clone().requires_grad_()
    loss = compiled(hidden, w, target)
    loss.backward()
    want_loss, want_grad = reference(hidden, weight, target)
    assert relative_error(loss.detach(), want_loss) < 1e-6
    assert relative_error(w.grad, want_grad) < 1e-6
    w_eager = weight.clone().requires_grad_()
    step(hidden, w_eager, target).backward()
    assert relative_error(w.grad, w_eager.grad) < 1e-6


def test_fullgraph_inductor_with_bf16_and_an_explicit_group_of_one():
    class OneRank:
        def rank(self):
            return 0

        def size(self):
            return 1

    hidden, weight, target = problem(dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    w = weight.clone().requires_grad_()
    loss = compiled(hidden, w, target, tp_group=OneRank())
    loss.backward()
    want_loss, _ = reference(hidden, weight, target)
    assert w.grad.dtype == torch.bfloat16
    assert relative_error(loss.detach().float(), want_loss) < 1e-2  # the bf16 matmul in front of it


def opcheck_samples():
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        logits = (torch.randn(5, 3, 24, generator=generator, dtype=torch.float64) * 3).to(dtype)
        target = torch.randint(0, 24, (5, 3), generator=generator)
        for smoothing, legacy, options in ((0.0, False, ""), (0.1, False, '{"z_loss_weight": 0.001}'),
                                           (0.1, True, "")):
            yield logits.clone().requires_grad_(), target, smoothing, legacy, options


@pytest.mark.parametrize("sample", list(opcheck_samples()))
def test_opcheck_forward(sample):
    logits, target, smoothing, legacy, options = sample
    torch.library.opcheck(torch.ops.vpce.cross_entropy_forward.default,
                          (logits, target, smoothing, 0, False, legacy, options))


@pytest.mark.parametrize("sample", list(opcheck_samples()))
def test_opcheck_backward(sample):
    logits, target, smoothing, legacy, options = sample
    _, lse = torch.ops.vpce.cross_entropy_forward(logits.detach(), target, smoothing, 0, False, legacy, options)
    grad_loss = torch.rand(target.shape)
    torch.library.opcheck(torch.ops.vpce.cross_entropy_backward.default,
                          (logits.detach(), target, lse, grad_loss, smoothing, 0, legacy, options))


def test_the_op_is_used_in_eager_mode_and_gives_the_reference(monkeypatch):
    def not_this_path(*args):
        raise AssertionError("the autograd.Function path, where the custom op should run")

    monkeypatch.setattr(vt._VpceCrossEntropy, "apply", not_this_path)
    hidden, weight, target = problem()
    logits = (hidden @ weight.t()).detach().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(logits, target, 0.1)
    grad_loss = torch.rand(4, 2)
    loss.backward(grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=0.1)
    assert relative_error(loss.detach(), want_loss) < 1e-6
    assert relative_error(logits.grad, want_grad) < 1e-6


@pytest.mark.parametrize("device", ["fake", "meta"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out of place", "in place"])
def test_tensors_without_values_give_shapes_forward_and_backward(device, inplace):
    # FakeTensorMode (shape propagation, memory planning) and the meta device: the loss's
    # shape and dtype and the logits' gradient's, with inplace_backward too (whose
    # autograd.Function handed the C++ code tensors without data).
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run():
        x = torch.randn(4, 3, 16, requires_grad=True, device="meta" if device == "meta" else "cpu")
        target = torch.randint(0, 16, (4, 3), device=x.device)
        loss = vt.vocab_parallel_cross_entropy(x * 1, target, 0.1, inplace_backward=inplace)
        assert loss.shape == (4, 3) and loss.dtype == torch.float32
        loss.sum().backward()
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype

    if device == "fake":
        with FakeTensorMode():
            run()
    else:
        run()
