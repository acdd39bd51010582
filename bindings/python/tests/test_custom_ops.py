"""vpce's custom ops (PyTorch >= 2.4) called directly, as their documented names let users
do, with each tensor argument in turn on another device (meta among CPU tensors) or of a
dtype the op does not take: the real implementation and the fake one (under
FakeTensorMode) both raise an error naming the op and the argument, never return
uninitialised memory; the same arguments on the right device and dtype run."""
import pytest
import torch

import vpce.torch as vt

pytestmark = pytest.mark.skipif(not vt._CUSTOM_OPS, reason="torch.library.custom_op needs PyTorch >= 2.4")

TOKENS, VOCAB, HIDDEN = 6, 10, 4


def loss_samples():
    """(op, tensor arguments by name, the other arguments, which tensor sets the device)."""
    logits = torch.randn(TOKENS, VOCAB)
    target = torch.randint(0, VOCAB, (TOKENS,))
    lse = torch.logsumexp(logits.double(), dim=-1)
    grad_loss = torch.ones(TOKENS)
    yield ("cross_entropy_forward", {"logits": logits, "target": target}, (0.0, 0, False, False, ""))
    yield ("cross_entropy_backward", {"logits": logits, "target": target, "lse": lse, "grad_loss": grad_loss},
           (0.0, 0, False, ""))


def head_samples():
    hidden = torch.randn(TOKENS, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN)
    bias = torch.randn(VOCAB)
    target = torch.randint(0, VOCAB, (TOKENS,))
    lse = torch.logsumexp((hidden @ weight.T + bias).double(), dim=-1)
    grad_loss = torch.ones(TOKENS)
    operands = {"hidden": hidden, "weight": weight, "bias": bias, "target": target}
    yield ("linear_cross_entropy_forward", operands, (0.0, 0, False, "", True))
    yield ("linear_cross_entropy_backward", {**operands, "lse": lse, "grad_loss": grad_loss},
           (0.0, 0, False, "", True, True, True))
    yield ("linear_cross_entropy_chunked", operands, (0.0, 0, False, '{"reduction": "sum"}', True, True, True))


SAMPLES = list(loss_samples()) + list(head_samples())
# A dtype each argument does not take.
WRONG_DTYPE = {"logits": torch.int32, "hidden": torch.int32, "weight": torch.float16, "bias": torch.float16,
               "target": torch.float32, "lse": torch.int64, "grad_loss": torch.int64}


def call(op, tensors, others):
    return getattr(torch.ops.vpce, op)(*tensors.values(), *others)


def cases():
    for op, tensors, others in SAMPLES:
        for name in tensors:
            yield pytest.param(op, tensors, others, name, "device", id=f"{op}-{name}-meta")
            yield pytest.param(op, tensors, others, name, "dtype", id=f"{op}-{name}-dtype")


def altered(tensors, name, what):
    changed = dict(tensors)
    tensor = tensors[name]
    changed[name] = tensor.to("meta") if what == "device" else tensor.to(WRONG_DTYPE[name])
    return changed


@pytest.mark.parametrize("op,tensors,others", [pytest.param(*s, id=s[0]) for s in SAMPLES])
def test_the_right_arguments_run(op, tensors, others):
    outputs = call(op, tensors, others)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert all(o.device.type == "cpu" for o in outputs)
    assert torch.isfinite(outputs[0]).all()


@pytest.mark.parametrize("op,tensors,others,name,what", list(cases()))
def test_a_wrong_argument_is_named_by_the_real_implementation(op, tensors, others, name, what):
    first = next(iter(tensors))
    with pytest.raises((ValueError, TypeError)) as raised:
        call(op, altered(tensors, name, what), others)
    message = str(raised.value)
    assert message.startswith(f"vpce::{op}: "), message
    if what == "device" and name == first:
        # The others are compared with its device (a meta first tensor takes the op to its
        # fake implementation, the meta kernel): the second is named.
        second = list(tensors)[1]
        assert f"{second}.device: expected meta (the device of {first}), got cpu" in message, message
    elif what == "device":
        assert f"{name}.device: expected cpu (the device of {first}), got meta" in message, message
    else:
        assert f"{name}.dtype: expected one of" in message and str(WRONG_DTYPE[name]) in message, message


@pytest.mark.parametrize("op,tensors,others,name,what", list(cases()))
def test_a_wrong_argument_is_named_by_the_fake_implementation(op, tensors, others, name, what):
    from torch._subclasses.fake_tensor import FakeTensorMode

    first = next(iter(tensors))
    if what == "device" and name == first:  # a meta reference: the others are then on another device
        name = next(n for n in tensors if n != first)
    bad = altered(tensors, name, what)
    with FakeTensorMode() as mode:
        fakes = {n: mode.from_tensor(t) for n, t in bad.items()}
        with pytest.raises((ValueError, TypeError)) as raised:
            call(op, fakes, others)
    message = str(raised.value)
    assert f"vpce::{op}: {name}.{what}" in message, message
