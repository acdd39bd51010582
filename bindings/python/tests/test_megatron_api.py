"""vpce.torch as megatron.core.tensor_parallel.cross_entropy: every name of the seed's API
(docs: core.tensor_parallel.cross_entropy) with its signature, and each static helper's
documented behaviour (what it overwrites in place, what it leaves untouched, what it
returns, in which shapes and dtypes) against float64 references computed here with torch,
on vpce's CPU row kernels and on the torch fallback (a non-contiguous input); explicit and
default tp_group on one rank. Runs on every PyTorch (no Megatron needed); the comparisons
against the real megatron-core are in test_megatron_core.py."""
import inspect
import math
import sys
import types

import pytest
import torch

import vpce.torch as vt
from reference import loss_and_grad, relative_error

VPCE = vt.VocabParallelCrossEntropy

# The seed's signatures (parameter names and defaults, in order).
SEED_SIGNATURES = {
    "calculate_logits_max": ["vocab_parallel_logits"],
    "gather_predicted_logits": ["vocab_parallel_logits", "target", "logits_max", "vocab_start_index",
                                "vocab_end_index"],
    "exp_logits_inplace": ["vocab_parallel_logits", "logits_max"],
    "calculate_predicted_logits": ["vocab_parallel_logits", "target", "logits_max", "vocab_start_index",
                                   "vocab_end_index"],
    "calculate_cross_entropy_loss": ["exp_logits", "predicted_logits", "sum_exp_logits"],
    "prepare_gradient_calculation_operands": ["softmax", "target_mask"],
    "scale_gradients_inplace": ["grad_input", "grad_output"],
    "calculate_gradients": ["grad_2d", "arange_1d", "masked_target_1d", "softmax_update", "grad_input",
                            "grad_output"],
}


def parameters(function):
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_static_helpers_have_the_seeds_signatures(name):
    assert isinstance(inspect.getattr_static(VPCE, name), staticmethod)
    assert [n for n, _ in parameters(getattr(VPCE, name))] == SEED_SIGNATURES[name]


def test_module_functions_have_the_seeds_signatures():
    empty = inspect.Parameter.empty
    assert parameters(vt._VocabParallelCrossEntropy.forward) == [
        ("ctx", empty), ("vocab_parallel_logits", empty), ("target", empty), ("label_smoothing", 0.0),
        ("tp_group", None)]
    assert parameters(vt._VocabParallelCrossEntropy.backward) == [("ctx", empty), ("grad_output", empty)]
    assert issubclass(vt._VocabParallelCrossEntropy, torch.autograd.Function)
    assert parameters(vt.unfused_cross_entropy) == [("logits", empty), ("labels", empty), ("tp_group", None)]
    assert parameters(vt.fused_vocab_parallel_cross_entropy) == [
        ("vocab_parallel_logits", empty), ("target", empty), ("tp_group", empty)]
    signature = inspect.signature(vt.vocab_parallel_cross_entropy)
    positional = [(p.name, p.default) for p in signature.parameters.values()
                  if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [("vocab_parallel_logits", empty), ("target", empty), ("label_smoothing", 0.0),
                          ("tp_group", None)]
    # vpce's own switches and options are keyword-only.
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    assert kinds["inplace_backward"] == kinds["megatron_legacy_label_smoothing"] == inspect.Parameter.KEYWORD_ONLY
    assert kinds["options"] == inspect.Parameter.VAR_KEYWORD
    for name in ("get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
                 "get_tensor_model_parallel_world_size"):
        assert callable(getattr(vt, name))  # Megatron's module has them; its tests patch them


def problem(shape=(6, 3), vocab=37, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, 3 * vocab, shape, generator=generator)  # most on "other ranks"
    return logits, target


def strided(x):
    """The same values, not contiguous (the torch fallback's path)."""
    wide = torch.empty(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


LAYOUTS = [lambda x: x.clone(), strided]
LAYOUT_IDS = ["contiguous (vpce's kernels)", "strided (torch)"]


def ulps(actual, expected):
    """|actual - expected| in units of float32's last place at expected (float64 in)."""
    expected = expected.double()
    spacing = torch.pow(2.0, torch.floor(torch.log2(expected.abs().clamp_min(2.0**-126))) - 23)
    return ((actual.double() - expected).abs() / spacing).max().item()


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_calculate_logits_max(dtype, layout):
    logits, _ = problem(dtype=dtype)
    x = layout(logits)
    before = x.clone()
    widened, logits_max = VPCE.calculate_logits_max(x)
    assert widened.dtype == logits_max.dtype == torch.float32
    assert widened.shape == x.shape and logits_max.shape == x.shape[:-1]
    if dtype == torch.float32:
        assert widened is x or torch.equal(widened, x)  # .float(): the same tensor, or equal values
    else:
        assert widened.data_ptr() != x.data_ptr()
    assert torch.equal(widened.double(), before.double())  # exact widening
    assert torch.equal(logits_max.double(), before.double().max(dim=-1)[0])
    assert torch.equal(x, before)  # the input is not modified


def test_calculate_logits_max_propagates_nan():
    x, _ = problem()
    x[1, 2, 5] = float("nan")
    _, logits_max = VPCE.calculate_logits_max(x)
    assert torch.isnan(logits_max[1, 2]) and not torch.isnan(logits_max[1, 1])


def masked_reference(logits, target, begin, end):
    mask = (target < begin) | (target >= end)
    local = (target - begin).masked_fill(mask, 0)
    return mask, local


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_gather_predicted_logits_is_read_only(layout):
    logits, target = problem()
    begin, end = 37, 74
    x = layout(logits)
    logits_max = logits.max(dim=-1)[0]
    before = x.clone()
    target_mask, masked_target_1d, predicted = VPCE.gather_predicted_logits(x, target, logits_max, begin, end)
    assert torch.equal(x, before)
    mask, local = masked_reference(logits, target, begin, end)
    assert torch.equal(target_mask, mask) and target_mask.dtype == torch.bool
    assert torch.equal(masked_target_1d, local.reshape(-1)) and masked_target_1d.dtype == target.dtype
    assert predicted.shape == target.shape and predicted.dtype == torch.float32
    picked = logits.double().gather(-1, local.unsqueeze(-1)).squeeze(-1)
    want = (picked - logits_max.double()).float().masked_fill(mask, 0.0)  # one float32 rounding
    assert torch.equal(predicted, want)
    assert mask.any() and (~mask).any()


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_exp_logits_inplace(layout):
    logits, _ = problem()
    x = layout(logits)
    logits_max = logits.max(dim=-1)[0]
    pointer = x.data_ptr()
    assert VPCE.exp_logits_inplace(x, logits_max) is None
    assert x.data_ptr() == pointer
    want = torch.exp((logits.double() - logits_max.double().unsqueeze(-1)).float().double())
    assert ulps(x, want) <= 1.25


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_calculate_predicted_logits_overwrites_the_logits_with_exp(layout):
    logits, target = problem()
    begin, end = 0, 37
    x = layout(logits)
    logits_max = logits.max(dim=-1)[0]
    out = VPCE.calculate_predicted_logits(x, target, logits_max, begin, end)
    assert len(out) == 5
    target_mask, masked_target_1d, predicted, sum_exp_logits, exp_logits = out
    assert exp_logits is x  # the logits, overwritten in place
    mask, local = masked_reference(logits, target, begin, end)
    assert torch.equal(target_mask, mask) and torch.equal(masked_target_1d, local.reshape(-1))
    shifted = (logits.double() - logits_max.double().unsqueeze(-1)).float().double()
    want_predicted = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(mask, 0.0)
    assert torch.equal(predicted.double(), want_predicted) and predicted.dtype == torch.float32
    assert ulps(exp_logits, shifted.exp()) <= 1.25
    assert sum_exp_logits.shape == target.shape and sum_exp_logits.dtype == torch.float32
    assert ulps(sum_exp_logits, exp_logits.double().sum(-1)) <= 8  # float32 sums of 37 terms


def test_calculate_cross_entropy_loss():
    logits, target = problem()
    exp_logits = torch.rand(6, 3, 37) + 0.1
    sums = exp_logits.double().sum(-1).float()
    predicted = torch.randn(6, 3)
    before = exp_logits.clone()
    softmax, loss = VPCE.calculate_cross_entropy_loss(exp_logits, predicted, sums)
    assert softmax is exp_logits
    assert torch.equal(softmax, before / sums.unsqueeze(-1))
    assert torch.equal(loss, torch.log(sums) - predicted)


def test_prepare_gradient_calculation_operands():
    softmax = torch.rand(6, 3, 37)
    mask = torch.rand(6, 3) > 0.5
    before = softmax.clone()
    grad_2d, arange_1d, softmax_update, grad_input = VPCE.prepare_gradient_calculation_operands(softmax, mask)
    assert grad_input is softmax and torch.equal(softmax, before)
    assert grad_2d.shape == (18, 37) and grad_2d.data_ptr() == softmax.data_ptr()
    assert torch.equal(arange_1d, torch.arange(18))
    assert softmax_update.dtype == torch.float32 and torch.equal(softmax_update, (~mask).reshape(-1).float())


def test_scale_gradients_inplace():
    grad = torch.rand(6, 3, 37)
    scale = torch.rand(6, 3)
    before = grad.clone()
    assert VPCE.scale_gradients_inplace(grad, scale) is None
    assert torch.equal(grad, before * scale.unsqueeze(-1))


def test_calculate_gradients_in_place():
    softmax = torch.rand(6, 3, 37)
    mask = torch.rand(6, 3) > 0.5
    local = torch.randint(0, 37, (18,))
    grad_output = torch.rand(6, 3)
    want = softmax.double().reshape(18, 37).clone()
    want[torch.arange(18), local] -= (~mask).reshape(-1).double()
    want = (want.reshape(6, 3, 37) * grad_output.double().unsqueeze(-1))
    grad_2d, arange_1d, update, grad_input = VPCE.prepare_gradient_calculation_operands(softmax, mask)
    out = VPCE.calculate_gradients(grad_2d, arange_1d, local, update, grad_input, grad_output)
    assert out is softmax
    assert relative_error(out, want) < 1e-6


def megatron_sequence(logits, target, begin, end, grad_output):
    """Megatron's forward and backward for one rank composed from the helpers as its fused
    path does (fusions/fused_cross_entropy.py), a group of one rank: no all-reduce."""
    x, logits_max = VPCE.calculate_logits_max(logits)
    mask, masked_1d, predicted, sums, exp_logits = VPCE.calculate_predicted_logits(x, target, logits_max, begin, end)
    softmax, loss = VPCE.calculate_cross_entropy_loss(exp_logits, predicted, sums)
    grad_2d, arange_1d, update, grad_input = VPCE.prepare_gradient_calculation_operands(softmax, mask)
    grad = VPCE.calculate_gradients(grad_2d, arange_1d, masked_1d, update, grad_input, grad_output)
    return loss, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_helpers_composed_as_megatron_does_give_the_loss(dtype):
    logits, target = problem(dtype=dtype, shape=(8, 2), vocab=300)
    target %= 300
    grad_output = torch.rand(8, 2) + 0.5
    want_loss, want_grad = loss_and_grad(logits, target, grad_output)
    loss, grad = megatron_sequence(logits.clone(), target, 0, 300, grad_output)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def test_the_seeds_split_helpers_compose_like_calculate_predicted_logits():
    logits, target = problem(vocab=64)
    x1, m1 = VPCE.calculate_logits_max(logits.clone())
    x2, m2 = VPCE.calculate_logits_max(logits.clone())
    a = VPCE.calculate_predicted_logits(x1, target, m1, 64, 128)
    mask, masked_1d, predicted = VPCE.gather_predicted_logits(x2, target, m2, 64, 128)
    VPCE.exp_logits_inplace(x2, m2)
    assert torch.equal(a[0], mask) and torch.equal(a[1], masked_1d) and torch.equal(a[2], predicted)
    assert torch.equal(a[4], x2)


class FakeGroup:
    """An object with only .rank() and .size(), as Megatron's own test passes."""

    def __init__(self, size=1):
        self._size = size

    def rank(self):
        return 0

    def size(self):
        return self._size


def test_an_explicit_group_of_one_needs_no_torch_distributed(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("an explicit tp_group must not consult Megatron's parallel_state")

    monkeypatch.setattr(vt, "get_tensor_model_parallel_group", forbidden)
    logits, target = problem()
    target %= 37
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 37).double(), target.reshape(-1), reduction="none")
    for call in (lambda x: vt.vocab_parallel_cross_entropy(x, target, tp_group=FakeGroup()),
                 lambda x: vt._VocabParallelCrossEntropy.apply(x, target, 0.0, FakeGroup()),
                 lambda x: vt.fused_vocab_parallel_cross_entropy(x, target, FakeGroup()),
                 lambda x: vt.unfused_cross_entropy(x, target, tp_group=FakeGroup())):
        loss = call(logits.clone())
        assert relative_error(loss.reshape(-1), want) < 1e-6


def test_tp_group_none_calls_the_get_tensor_model_parallel_group_patched_on_this_module(monkeypatch):
    # Megatron's tests patch the module's get_tensor_model_parallel_group: with Megatron
    # initialised, tp_group=None must take its group from the patched function.
    def megatrons_own(check_initialized=True):
        raise AssertionError("tp_group=None must call vpce.torch.get_tensor_model_parallel_group, as patched")

    state = types.SimpleNamespace(model_parallel_is_initialized=lambda: True,
                                  get_tensor_model_parallel_group=megatrons_own)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    calls = []
    monkeypatch.setattr(vt, "get_tensor_model_parallel_group", lambda: calls.append("patched") or FakeGroup())
    logits, target = problem()
    target %= 37
    grad_output = torch.rand(6, 3)
    want_loss, want_grad = loss_and_grad(logits, target, grad_output)
    for call in (lambda x: vt.vocab_parallel_cross_entropy(x, target),
                 lambda x: vt._VocabParallelCrossEntropy.apply(x, target),
                 lambda x: vt.unfused_cross_entropy(x, target)):
        calls.clear()
        x = logits.clone().requires_grad_()
        loss = call(x)
        loss.backward(grad_output)
        assert calls and set(calls) == {"patched"}
        assert relative_error(loss, want_loss) < 1e-6 and relative_error(x.grad, want_grad) < 1e-6


def test_an_explicit_group_of_several_without_torch_distributed_is_refused():
    logits, target = problem()
    with pytest.raises(ValueError, match="tp_group: expected an initialised torch.distributed for a group of 2"):
        vt.vocab_parallel_cross_entropy(logits, target % 37, tp_group=FakeGroup(2))


def test_megatron_autograd_function_takes_megatrons_arguments():
    logits, target = problem(vocab=40)
    target %= 40
    grad_output = torch.rand(6, 3)
    for args in ((), (0.1,), (0.1, None)):
        x = logits.clone().requires_grad_()
        loss = vt._VocabParallelCrossEntropy.apply(x, target, *args)
        loss.backward(grad_output)
        smoothing = args[0] if args else 0.0
        want_loss, want_grad = loss_and_grad(logits, target, grad_output, label_smoothing=smoothing)
        assert relative_error(loss, want_loss) < 1e-6 and relative_error(x.grad, want_grad) < 1e-6
        assert not math.isnan(loss.sum().item())


def test_cpu_helpers_run_on_vpces_kernels(monkeypatch):
    calls = []
    for name in ("row_max", "exp_rows_in_place"):
        original = getattr(vt._vpce, name)
        monkeypatch.setattr(vt._vpce, name, lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    logits, target = problem()
    x, logits_max = VPCE.calculate_logits_max(logits.to(torch.bfloat16))
    VPCE.calculate_predicted_logits(x, target, logits_max, 0, 37)
    VPCE.exp_logits_inplace(logits, logits_max)
    assert calls == ["row_max", "exp_rows_in_place", "exp_rows_in_place"]
    calls.clear()
    VPCE.calculate_logits_max(strided(logits))  # not contiguous: torch's operations
    with torch.enable_grad():
        VPCE.calculate_logits_max(logits.clone().requires_grad_())  # recorded by autograd: torch's
    assert calls == []
