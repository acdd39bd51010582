"""vpce.torch.linear_cross_entropy, the fused head (linear + vocab-parallel cross-entropy
without the logits), against a float64 reference built from PyTorch's own operations (the
logits hidden @ weight.T + bias in float64, then F.cross_entropy in float64; the z-loss,
logit scale and soft-cap from their formulas in docs/options.md): the loss within 1e-6
(relative to its largest value) and the gradients of hidden, weight and bias within 1e-5
for float32, within bf16 rounding for bfloat16; every loss option, every reduction, both
modes (recompute and chunked), small tiles and chunks, float64 inputs, Megatron's gradient-
accumulation fusion into weight.main_grad, errors; on gloo groups of 1, 2 and 4 processes
with equal and uneven vocabulary slices, replicated and sequence-parallel hidden states,
the collectives of each mode counted, the same loss on every rank and a rank that fails
before the gathers giving every rank its error; on PyTorch >= 2.4 the custom ops under
torch.compile (no graph break, inductor against the reference, opcheck); with the real
megatron-core, docs/python.md's replacement of GPTModel's output layer and loss against
Megatron's own ColumnParallelLinear and vocab_parallel_cross_entropy on groups of 1 and 2.
The tests that need torch.library.custom_op or megatron-core skip on PyTorch 1.13."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vpce
import vpce.torch as vt
from vpce import _torch_head
from reference import relative_error
from test_distributed import CollectiveCounter, init_group, same_outcome_on_every_rank, spawn

CUSTOM_OPS = vt._CUSTOM_OPS
needs_custom_ops = pytest.mark.skipif(not CUSTOM_OPS, reason="torch.library.custom_op needs PyTorch >= 2.4")


# ---- the float64 reference ----------------------------------------------------------------

def reference(hidden, weight, bias, target, grad_loss=None, label_smoothing=0.0, smoothing_semantics="megatron",
              ignore_index=-100, z_loss_weight=0.0, logit_scale=1.0, softcap=0.0, valid_vocab_size=0,
              reduction="none"):
    """(loss, grad_hidden, grad_weight, grad_bias) in float64 of the whole output layer:
    logits = hidden @ weight.T + bias (the full vocabulary), then PyTorch's cross_entropy
    of the transformed logits (scale, soft-cap, the valid columns), plus the z-loss."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    logits = h @ w.t() if b is None else h @ w.t() + b
    z = logits * logit_scale
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    if valid_vocab_size:
        z = z[..., :valid_vocab_size]
    vocab = z.shape[-1]
    a = label_smoothing * vocab / (vocab - 1) if smoothing_semantics == "megatron" else label_smoothing
    flat, y = z.reshape(-1, vocab), target.reshape(-1)
    per_token = F.cross_entropy(flat, y, reduction="none", label_smoothing=a, ignore_index=ignore_index)
    counted = (y != ignore_index).double()
    if z_loss_weight:
        per_token = per_token + z_loss_weight * torch.logsumexp(flat, dim=-1) ** 2 * counted
    if reduction == "none":
        loss = per_token.view(target.shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        count = counted.sum()
        loss = per_token.sum() / count if count > 0 else per_token.sum() * 0
    if grad_loss is None:
        grad_loss = torch.ones(loss.shape)
    inputs = [h, w] + ([] if b is None else [b])
    grads = torch.autograd.grad(loss, inputs, grad_loss.double().reshape(loss.shape))
    return (loss.detach(), *grads) if b is not None else (loss.detach(), *grads, None)


def problem(seed=0, shape=(7, 3), hidden_size=24, vocab=151, dtype=torch.float32, with_bias=True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64) * 0.5).to(dtype)
    bias = (torch.randn(vocab, generator=generator, dtype=torch.float64) * 0.3).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, shape, generator=generator)
    return hidden, weight, bias, target


def upstream(loss_shape, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(loss_shape, generator=generator) + 0.5


def leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


def run(hidden, weight, bias, target, label_smoothing=0.0, grad_loss=None, **options):
    """vpce's loss and gradients: (loss, grad_hidden, grad_weight, grad_bias)."""
    h, w, b = leaves(hidden, weight, bias)
    loss = vt.linear_cross_entropy(h, w, target, label_smoothing, bias=b, **options)
    loss.backward(torch.ones(loss.shape) if grad_loss is None else grad_loss)
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


def close(actual, expected, tolerance):
    """Within `tolerance` of the largest expected value (shapes equal; empty is close)."""
    assert actual is not None and actual.shape == expected.shape, (actual, expected.shape)
    return expected.numel() == 0 or relative_error(actual, expected) < tolerance


def check_fp32(got, want, loss_tolerance=1e-6, grad_tolerance=1e-5):
    assert close(got[0], want[0], loss_tolerance), (got[0], want[0])
    for name, g, r in zip(("hidden", "weight", "bias"), got[1:], want[1:]):
        if r is None:
            assert g is None, name
            continue
        assert close(g, r, grad_tolerance), (name, relative_error(g, r) if r.numel() else None)


# ---- one rank ------------------------------------------------------------------------------

OPTION_CASES = [
    ("plain", 0.0, {}),
    ("megatron smoothing", 0.1, {}),
    ("pytorch smoothing and ignore_index", 0.2, {"smoothing_semantics": "pytorch", "ignore_index": 5}),
    ("z-loss", 0.0, {"z_loss_weight": 1e-2}),
    ("logit scale and soft-cap", 0.1, {"logit_scale": 0.7, "softcap": 3.0}),
    ("padded vocabulary", 0.1, {"valid_vocab_size": 140}),
    ("every option", 0.1, {"smoothing_semantics": "pytorch", "ignore_index": 3, "z_loss_weight": 1e-3,
                           "logit_scale": 1.3, "softcap": 5.0, "valid_vocab_size": 145}),
]
MODES = [("recompute", "none"), ("recompute", "sum"), ("recompute", "mean"), ("chunked", "sum"),
         ("chunked", "mean")]


def with_ignored_tokens(target, options):
    target = target.clone()
    if "ignore_index" in options:
        target[0] = options["ignore_index"]  # a whole row of ignored tokens
    if "valid_vocab_size" in options:
        target = target % options["valid_vocab_size"]
    return target


@pytest.mark.parametrize("mode,reduction", MODES, ids=[f"{m}-{r}" for m, r in MODES])
@pytest.mark.parametrize("name,label_smoothing,options", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
def test_fp32_matches_the_float64_reference(mode, reduction, name, label_smoothing, options, with_bias):
    hidden, weight, bias, target = problem(with_bias=with_bias)
    target = with_ignored_tokens(target, options)
    want_shape = tuple(target.shape) if reduction == "none" else ()
    grad_loss = upstream(want_shape)
    got = run(hidden, weight, bias, target, label_smoothing, grad_loss, mode=mode, reduction=reduction, **options)
    want = reference(hidden, weight, bias, target, grad_loss, label_smoothing, reduction=reduction, **options)
    assert got[0].dtype == torch.float32
    check_fp32(got, want)


@pytest.mark.parametrize("mode,reduction", [("recompute", "none"), ("chunked", "mean")])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_logits_near_1e4_keep_the_gradients_fp32_accuracy(mode, reduction, label_smoothing):
    """A bias of 1e4 under products of a few units, every value a multiple of 1/4 so that the
    fp32 logits are the reference's exactly: the lse kept in float64 keeps the gradients
    within 1e-5 (a float32 lse's rounding, 2^-10 at 1e4, put 6e-4 into them)."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randint(-2, 3, (9, 16), generator=generator).float()
    weight = torch.randint(-2, 3, (120, 16), generator=generator).float() * 0.25
    bias = 1e4 + torch.randint(0, 3, (120,), generator=generator).float()
    target = torch.randint(0, 120, (9,), generator=generator)
    grad_loss = upstream(tuple(target.shape) if reduction == "none" else ())
    got = run(hidden, weight, bias, target, label_smoothing, grad_loss, mode=mode, reduction=reduction)
    want = reference(hidden, weight, bias, target, grad_loss, label_smoothing, reduction=reduction)
    check_fp32(got, want)


@pytest.mark.parametrize("mode,reduction", [("recompute", "none"), ("chunked", "mean")])
def test_small_tiles_and_chunks(mode, reduction):
    # 21 tokens in tiles of 4 x 16 (a partial tile at each end) and chunks of 8 tokens.
    hidden, weight, bias, target = problem(shape=(21,), vocab=75)
    grad_loss = upstream(tuple(target.shape) if reduction == "none" else ())
    want = reference(hidden, weight, bias, target, grad_loss, 0.1, reduction=reduction)
    for head in ({"token_block": 4, "vocab_block": 16, "chunk_tokens": 8}, {"token_block": 1, "vocab_block": 1},
                 {"token_block": 64, "vocab_block": 512}):
        got = run(hidden, weight, bias, target, 0.1, grad_loss, mode=mode, reduction=reduction, **head)
        check_fp32(got, want)


def test_the_thread_count_changes_no_bit():
    hidden, weight, bias, target = problem(shape=(40,), vocab=300)
    first = run(hidden, weight, bias, target, 0.1, num_threads=1)
    again = run(hidden, weight, bias, target, 0.1, num_threads=2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode,reduction", [("recompute", "none"), ("chunked", "sum")])
@pytest.mark.parametrize("dtype,rounding", [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-9)],
                         ids=["bf16", "fp16"])
def test_half_precision_within_its_rounding(mode, reduction, dtype, rounding):
    hidden, weight, bias, target = problem(dtype=dtype, hidden_size=64)
    grad_loss = upstream(tuple(target.shape) if reduction == "none" else ())
    got = run(hidden, weight, bias, target, 0.1, grad_loss, mode=mode, reduction=reduction)
    want = reference(hidden, weight, bias, target, grad_loss, 0.1, reduction=reduction)
    assert got[0].dtype == torch.float32
    assert relative_error(got[0], want[0]) < 1e-5  # fp32 GEMM on the half-precision values
    for g, r in zip(got[1:], want[1:]):
        assert g.dtype == dtype
        assert relative_error(g, r) < rounding  # each element rounded once to the dtype


def the_function_and_the_public_call_agree(hidden, weight, bias, target, grad_loss, options):
    """The autograd.Function and linear_cross_entropy (the custom ops on PyTorch >= 2.4):
    the same loss and gradients, bit for bit; returns the public call's."""
    h, w, b = leaves(hidden, weight, bias)
    loss = _torch_head._LinearCrossEntropy.apply(h, w, b, target, 0.1, None, False, options)
    loss.backward(grad_loss)
    got = run(hidden, weight, bias, target, 0.1, grad_loss, **options)
    assert torch.equal(loss.detach(), got[0])
    for a, c in zip((h.grad, w.grad, b.grad), got[1:]):
        assert torch.equal(a, c)
    return got


def rounded_logit_gradient_reference(hidden, weight, bias, target, label_smoothing, reduction):
    """(grad_hidden, grad_weight, grad_bias) in float64 from the logits' float64 gradient
    rounded to bfloat16 (through float32), as bf16_logit_gradients computes them."""
    h, w = hidden.detach().double(), weight.detach().double()
    logits = (h @ w.t() + bias.detach().double()).requires_grad_()
    vocab = logits.shape[-1]
    a = label_smoothing * vocab / (vocab - 1)  # Megatron's smoothing
    loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), label_smoothing=a, reduction=reduction)
    (dx,) = torch.autograd.grad(loss, logits)
    dx = dx.float().bfloat16().double().reshape(-1, vocab)
    return (dx @ w).view(hidden.shape), dx.t() @ h.reshape(-1, h.shape[-1]), dx.sum(0)


@pytest.mark.parametrize("mode,reduction", [("recompute", "mean"), ("chunked", "sum")])
def test_bf16_logit_gradients_within_their_rounding(mode, reduction):
    # bf16 operands; the weight's gradient added into an fp32 main_grad (no final rounding to
    # bf16), so that it shows which dx the GEMMs took: within 2^-8 of the largest of the exact
    # gradient, and far nearer the gradient of dx rounded to bf16 than the exact one is.
    hidden, weight, bias, target = problem(dtype=torch.bfloat16, hidden_size=64, shape=(40,), vocab=300)
    want = reference(hidden, weight, bias, target, None, 0.1, reduction=reduction)
    rounded = rounded_logit_gradient_reference(hidden, weight, bias, target, 0.1, reduction)
    h, w, b = leaves(hidden, weight, bias)
    w.main_grad = torch.zeros(weight.shape)
    loss = vt.linear_cross_entropy(h, w, target, 0.1, bias=b, mode=mode, reduction=reduction,
                                   gradient_accumulation_fusion=True, bf16_logit_gradients=True)
    loss.backward()
    assert relative_error(loss.detach(), want[0]) < 1e-5  # the loss keeps its fp32 logits
    assert relative_error(w.main_grad, want[2]) < 2.0**-8
    assert (w.main_grad.double() - rounded[1]).norm() < 0.25 * (want[2] - rounded[1]).norm()
    for g, r in ((h.grad, want[1]), (b.grad, want[3])):
        assert g.dtype == torch.bfloat16
        assert relative_error(g, r) < 2.0**-6  # dx's rounding, then the gradient's own
    default = run(hidden, weight, bias, target, 0.1, mode=mode, reduction=reduction)
    assert not torch.equal(default[1], h.grad)


def test_bf16_logit_gradients_take_the_same_path_through_the_ops_and_the_function():
    # Without main_grad the op path (PyTorch >= 2.4) carries the option in its JSON options:
    # the same bits as the autograd.Function, in both modes.
    hidden, weight, bias, target = problem(dtype=torch.bfloat16, hidden_size=32, shape=(20,), vocab=120)
    for mode, reduction in (("recompute", "none"), ("chunked", "mean")):
        options = {"mode": mode, "reduction": reduction, "bf16_logit_gradients": True}
        grad_loss = upstream(tuple(target.shape) if reduction == "none" else ())
        got = the_function_and_the_public_call_agree(hidden, weight, bias, target, grad_loss, options)
        default = run(hidden, weight, bias, target, 0.1, grad_loss, mode=mode, reduction=reduction)
        assert not torch.equal(default[2], got[2])  # the option reached the head


def test_strided_hidden_and_int32_targets():
    # Hidden states [b, s, H] transposed to [s, b, H] (copied), a weight that is a row
    # slice of a wider one (read in place), int32 targets.
    hidden, weight, bias, target = problem(shape=(3, 7))
    size = weight.shape[1]
    h = hidden.clone().requires_grad_()
    w = torch.cat([weight, weight], dim=1).requires_grad_()  # [V, 2H]: the first H columns are the weight
    loss = vt.linear_cross_entropy(h.transpose(0, 1), w[:, :size], target.t().int(), bias=bias)
    grad_loss = upstream(tuple(loss.shape))
    loss.backward(grad_loss)
    want = reference(hidden.transpose(0, 1), weight, bias, target.t(), grad_loss)
    check_fp32((loss.detach(), h.grad.transpose(0, 1), w.grad[:, :size], None), (*want[:3], None))
    assert not w.grad[:, size:].any()


def test_float64_inputs_are_computed_in_float32():
    hidden, weight, bias, target = problem(dtype=torch.float64)
    grad_loss = upstream(tuple(target.shape))
    got = run(hidden, weight, bias, target, 0.1, grad_loss)
    assert got[0].dtype == torch.float64 and all(g.dtype == torch.float64 for g in got[1:])
    check_fp32(got, reference(hidden, weight, bias, target, grad_loss, 0.1))


def test_only_the_gradients_asked_for():
    hidden, weight, bias, target = problem()
    want = reference(hidden, weight, bias, target, None, reduction="sum")
    for mode in ("recompute", "chunked"):
        w = weight.clone().requires_grad_()
        loss = vt.linear_cross_entropy(hidden, w, target, bias=bias, mode=mode, reduction="sum")
        loss.backward()
        assert relative_error(w.grad, want[2]) < 1e-5
        h = hidden.clone().requires_grad_()
        vt.linear_cross_entropy(h, weight, target, bias=bias, mode=mode, reduction="sum").backward()
        assert relative_error(h.grad, want[1]) < 1e-5
    with torch.no_grad():
        loss = vt.linear_cross_entropy(hidden.requires_grad_(), weight, target, mode="chunked", reduction="sum")
    assert not loss.requires_grad
    hidden.requires_grad_(False)


@pytest.mark.parametrize("mode", ["recompute", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_fusion_adds_into_main_grad(mode, dtype):
    hidden, weight, bias, target = problem(dtype=dtype)
    want = reference(hidden, weight, bias, target, None, reduction="mean")
    start = torch.randn(weight.shape, dtype=torch.float32)
    h, w, b = leaves(hidden, weight, bias)
    w.main_grad = start.clone()
    loss = vt.linear_cross_entropy(h, w, target, bias=b, mode=mode, reduction="mean",
                                   gradient_accumulation_fusion=True)
    loss.backward()
    assert w.grad is None  # as Megatron's layer returns without grad_added_to_main_grad
    assert w.main_grad.dtype == torch.float32
    tolerance = 1e-5  # fp32 sums of the products of the same (bf16) values, for both dtypes
    assert relative_error(w.main_grad - start, want[2]) < tolerance
    assert relative_error(h.grad, want[1]) < (1e-5 if dtype == torch.float32 else 2.0**-7)
    # With Megatron's overlapped gradient reduction (grad_added_to_main_grad): a dummy
    # gradient, zeros with zero_out_wgrad, and the flag set.
    w2 = weight.clone().requires_grad_()
    w2.main_grad = torch.zeros(weight.shape)
    w2.grad_added_to_main_grad = False
    w2.zero_out_wgrad = True
    vt.linear_cross_entropy(hidden, w2, target, bias=bias, mode=mode, reduction="mean",
                            gradient_accumulation_fusion=True).backward()
    assert w2.grad_added_to_main_grad is True
    assert w2.grad is not None and w2.grad.dtype == dtype and not w2.grad.any()
    assert relative_error(w2.main_grad, want[2]) < tolerance
    # Without the option main_grad is left alone and the gradient returned as usual.
    w3 = weight.clone().requires_grad_()
    w3.main_grad = start.clone()
    vt.linear_cross_entropy(hidden, w3, target, bias=bias, mode=mode, reduction="mean").backward()
    assert torch.equal(w3.main_grad, start)
    assert relative_error(w3.grad, want[2]) < (1e-5 if dtype == torch.float32 else 2.0**-7)


@pytest.mark.parametrize("mode", ["recompute", "chunked"])
def test_double_backward_raises_rather_than_dropping_the_second_derivative(mode):
    hidden, weight, bias, target = problem()
    hidden.requires_grad_()
    loss = vt.linear_cross_entropy(hidden, weight, target, bias=bias, mode=mode, reduction="sum")
    with pytest.raises(RuntimeError, match="expected a first derivative only"):
        torch.autograd.grad(loss, hidden, create_graph=True)


@pytest.mark.parametrize("mode", ["recompute", "chunked"])
def test_a_main_grad_attached_after_the_forward_is_added_into_in_both_modes(mode):
    hidden, weight, _, target = problem()
    weight.requires_grad_()
    loss = vt.linear_cross_entropy(hidden, weight, target, mode=mode, reduction="sum",
                                   gradient_accumulation_fusion=True)
    weight.main_grad = torch.zeros(weight.shape)
    loss.backward()
    want = reference(hidden, weight.detach(), None, target, None, reduction="sum")
    assert weight.grad is None
    assert relative_error(weight.main_grad, want[2]) < 1e-5


def test_an_integer_main_grad_is_refused():
    hidden, weight, _, target = problem()
    weight.requires_grad_()
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.int64)
    with pytest.raises(TypeError, match="weight.main_grad: expected a floating-point tensor"):
        vt.linear_cross_entropy(hidden, weight, target, reduction="sum", gradient_accumulation_fusion=True)


def test_chunked_mode_in_the_autograd_function_allows_one_backward():
    hidden, weight, bias, target = problem()
    h = hidden.clone().requires_grad_()
    loss = _torch_head._LinearCrossEntropy.apply(h, weight, None, target, 0.0, None, False,
                                                    {"mode": "chunked", "reduction": "sum"})
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_the_autograd_function_matches_the_custom_op_path():
    hidden, weight, bias, target = problem()
    for mode, reduction in (("recompute", "none"), ("recompute", "sum")):
        grad_loss = upstream(tuple(target.shape) if reduction == "none" else ())
        options = {"mode": mode, "reduction": reduction, "z_loss_weight": 1e-3}
        the_function_and_the_public_call_agree(hidden, weight, bias, target, grad_loss, options)


@pytest.mark.parametrize("arguments,options,kind,fragment", [
    ("bad option", {"colour": "red"}, TypeError, "linear_cross_entropy: unexpected options ['colour']"),
    ("bad mode", {"mode": "fast"}, ValueError, "mode: expected 'recompute' or 'chunked', got 'fast'"),
    ("chunked per token", {"mode": "chunked"}, ValueError, "mode: expected 'recompute' for reduction 'none'"),
    ("bad reduction", {"reduction": "avg"}, ValueError, "reduction: expected 'none', 'sum' or 'mean', got 'avg'"),
    ("bad block", {"token_block": "x"}, TypeError, "options.token_block: expected an integer"),
    ("bad accumulation flag", {"gradient_accumulation_fusion": 1}, TypeError,
     "gradient_accumulation_fusion: expected a bool"),
    ("bad vocab range", {"vocab_range": (0, 10)}, TypeError, "vocab_range: expected (vocab_begin, vocab_end"),
    ("bad bf16 flag", {"bf16_logit_gradients": 1}, TypeError, "options.bf16_logit_gradients: expected a bool, got int"),
    ("bf16 gradients of fp32", {"bf16_logit_gradients": True}, vpce.Error,
     "head.bf16_logit_gradients: expected false for float32 operands (bfloat16 only), got true"),
    ("a bool for an integer", {"ignore_index": True}, TypeError, "options.ignore_index: expected an integer, got bool"),
    ("a string for sequence_parallel", {"sequence_parallel": "no"}, TypeError,
     "sequence_parallel: expected a bool, got str 'no'"),
])
def test_option_errors_name_the_option(arguments, options, kind, fragment):
    hidden, weight, bias, target = problem()
    with pytest.raises(kind) as failure:
        vt.linear_cross_entropy(hidden, weight, target, bias=bias, **options)
    assert fragment in str(failure.value)


def test_operand_errors():
    hidden, weight, bias, target = problem()
    cases = [
        ((hidden, weight.double(), target), {}, TypeError, "weight.dtype: expected hidden's dtype torch.float32"),
        ((hidden, weight, target), {"bias": bias[:, None]}, ValueError, "bias.dim(): expected 1"),
        ((hidden, weight[0], target), {}, ValueError, "weight.dim(): expected 2"),
        ((hidden > 0, weight, target), {}, TypeError, "hidden.dtype: expected float32, bfloat16, float16 or float64"),
        ((hidden, weight, target.float()), {}, TypeError, "target.dtype: expected int32 or int64"),
        ((hidden, weight[:, :5], target), {}, vpce.Error, "weight"),
        ((hidden, weight, target[:2]), {}, ValueError, "target.shape: expected hidden's leading shape (7, 3)"),
        ((hidden, weight, target.T), {}, ValueError, "target.shape: expected hidden's leading shape (7, 3)"),
        ((hidden, weight, target.flatten()), {}, ValueError, "got (21,)"),
        ((hidden, weight, target + 1000), {}, vpce.Error, "targets"),
    ]
    for args, kwargs, kind, fragment in cases:
        with pytest.raises(kind) as failure:
            vt.linear_cross_entropy(*args, **kwargs)
        assert fragment in str(failure.value), (fragment, str(failure.value))


def test_the_dlpack_bindings_directly():
    # vpce._vpce's head functions on NumPy-free torch tensors: the staged statistics equal
    # those of the materialised logits, and the hidden gradient's reduction on one rank is
    # the identity.
    hidden, weight, bias, target = problem(shape=(9,))
    options = vpce.LossOptions()
    head = vpce._vpce.HeadOptions()
    stats = torch.empty(9, 4)
    vpce._vpce.linear_cross_entropy_local_stats(hidden, weight, bias, target, 0, 151, 151, options, head, stats)
    want = torch.empty(9, 4)
    logits = hidden @ weight.t() + bias
    vpce.calculate_local_stats(logits, target, 0, 151, 151, options, want)
    assert relative_error(stats[:, :3], want[:, :3]) < 1e-6
    g = torch.randn(9, 24)
    copy = g.clone()
    vpce._vpce.all_reduce_hidden_gradient(g)
    assert torch.equal(g, copy)
    with pytest.raises(vpce.Error, match="all_gather: expected a callable"):
        vpce._vpce.all_reduce_hidden_gradient(g, rank=0, size=2)
    head.token_block = 16
    assert head.token_block == 16
    with pytest.raises(TypeError, match="options.vocab_block: expected an integer"):
        head.vocab_block = 1.5


# ---- torch.compile and the custom ops (PyTorch >= 2.4) -------------------------------------

def compiled_step(hidden, weight, bias, target, **options):
    return vt.linear_cross_entropy(hidden, weight, target, 0.1, bias=bias, **options).sum()


@needs_custom_ops
def test_registered_ops():
    for name in ("linear_cross_entropy_forward", "linear_cross_entropy_backward", "linear_cross_entropy_chunked"):
        assert hasattr(torch.ops.vpce, name), name


@needs_custom_ops
@pytest.mark.parametrize("options", [{}, {"mode": "chunked", "reduction": "mean"}], ids=["recompute", "chunked"])
def test_a_step_traces_with_no_graph_break(options):
    hidden, weight, bias, target = problem()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(compiled_step)(hidden, weight.clone().requires_grad_(), bias, target,
                                                       **options)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@needs_custom_ops
@pytest.mark.parametrize("options", [{}, {"mode": "chunked", "reduction": "mean"}], ids=["recompute", "chunked"])
def test_fullgraph_inductor_matches_the_reference(options):
    hidden, weight, bias, target = problem()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_step, fullgraph=True)
    h, w, b = leaves(hidden, weight, bias)
    loss = compiled(h, w, b, target, **options)
    loss.backward()
    reduction = options.get("reduction", "none")
    want = reference(hidden, weight, bias, target, None, 0.1, reduction=reduction)
    want = (want[0].sum(), *want[1:]) if reduction == "none" else want
    check_fp32((loss.detach(), h.grad, w.grad, b.grad), want)


def opcheck_samples():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for with_bias in (True, False):
            hidden, weight, bias, target = problem(shape=(5, 3), vocab=40, dtype=dtype, with_bias=with_bias)
            for smoothing, options in ((0.0, ""), (0.1, '{"z_loss_weight": 0.001, "reduction": "mean"}')):
                yield hidden, weight, bias, target, smoothing, options


@needs_custom_ops
@pytest.mark.parametrize("sample", list(opcheck_samples()))
def test_opcheck(sample):
    hidden, weight, bias, target, smoothing, options = sample
    h, w, b = leaves(hidden, weight, bias)
    torch.library.opcheck(torch.ops.vpce.linear_cross_entropy_forward.default,
                          (h, w, b, target, smoothing, 0, False, options, True))
    _, lse = torch.ops.vpce.linear_cross_entropy_forward(hidden, weight, bias, target, smoothing, 0, False, options,
                                                         True)
    grad_loss = torch.rand(tuple(target.shape) if "reduction" not in options else ())
    torch.library.opcheck(torch.ops.vpce.linear_cross_entropy_backward.default,
                          (hidden, weight, bias, target, lse, grad_loss, smoothing, 0, False, options, True, True,
                           bias is not None))
    if "reduction" in options:
        torch.library.opcheck(torch.ops.vpce.linear_cross_entropy_chunked.default,
                              (h, w, b, target, smoothing, 0, False, options, True, True, bias is not None))


@needs_custom_ops
def test_the_op_is_used_in_eager_mode_for_the_recompute_mode(monkeypatch):
    # (The chunked mode takes the autograd.Function in eager mode, which scales the
    # gradients in place; the custom op's backward cannot change its outputs.)
    def not_this_path(*args):
        raise AssertionError("the autograd.Function path, where the custom op should run")

    monkeypatch.setattr(_torch_head._LinearCrossEntropy, "apply", not_this_path)
    hidden, weight, bias, target = problem()
    for options in ({}, {"reduction": "mean"}):
        got = run(hidden, weight, bias, target, 0.1, **options)
        check_fp32(got, reference(hidden, weight, bias, target, None, 0.1, reduction=options.get("reduction",
                                                                                                   "none")))


@needs_custom_ops
def test_the_chunked_op_in_eager_mode_gives_the_reference():
    hidden, weight, bias, target = problem()
    h, w, b = leaves(hidden, weight, bias)
    loss, *_ = torch.ops.vpce.linear_cross_entropy_chunked(h, w, b, target, 0.1, 0, False, '{"reduction": "sum"}',
                                                           True, True, True)
    grad_loss = upstream(())
    loss.backward(grad_loss)
    want = reference(hidden, weight, bias, target, grad_loss, 0.1, reduction="sum")
    check_fp32((loss.detach(), h.grad, w.grad, b.grad), want)


# ---- gloo groups ---------------------------------------------------------------------------

def slices(vocab, size, uneven):
    """Each rank's [begin, end) of the vocabulary: equal, or uneven (one of them empty for
    4 ranks)."""
    if not uneven:
        return [(r * vocab // size, (r + 1) * vocab // size) for r in range(size)]
    cuts = {1: [0, vocab], 2: [0, vocab // 3, vocab], 4: [0, 30, 30, 31, vocab]}[size]
    return list(zip(cuts[:-1], cuts[1:]))


def check_group_case(group, rank, size, *, mode="recompute", reduction="none", dtype=torch.float32,
                     label_smoothing=0.0, uneven=False, sequence_parallel=False, main_grad=False, options=None):
    options = dict(options or {})
    vocab = 4 * 37
    hidden, weight, bias, target = problem(seed=7, shape=(8, 2), vocab=vocab, dtype=dtype)
    target = with_ignored_tokens(target, options)
    begin, end = slices(vocab, size, uneven)[rank]
    if uneven:
        options["vocab_range"] = (begin, end, vocab)
    tokens = hidden.shape[0] // size
    local_hidden = hidden[rank * tokens:(rank + 1) * tokens] if sequence_parallel else hidden
    h, w, b = leaves(local_hidden, weight[begin:end], bias[begin:end])
    if main_grad:
        w.main_grad = torch.zeros(w.shape)
        options["gradient_accumulation_fusion"] = True
    with CollectiveCounter() as forward_calls:
        loss = vt.linear_cross_entropy(h, w, target, label_smoothing, group, bias=b,
                                       sequence_parallel=sequence_parallel, mode=mode, reduction=reduction,
                                       **options)
    grad_loss = upstream(tuple(loss.shape))
    with CollectiveCounter() as backward_calls:
        loss.backward(grad_loss)

    # The collectives: the loss's one all-gather (one per chunk in the chunked mode), the
    # hidden states' before it with sequence parallelism; the hidden gradient's reduction in
    # the backward (after the hidden states' all-gather again, with sequence parallelism),
    # in the forward for the chunked mode: an all-reduce, or a reduce-scatter (an all-reduce
    # where gloo has none: PyTorch 1.13, which is found out once by trying).
    if sequence_parallel:
        reductions = (["reduce_scatter_tensor"], ["reduce_scatter_tensor", "all_reduce"], ["all_reduce"])
    else:
        reductions = (["all_reduce"],)
    chunks = 1
    if mode == "chunked" and "chunk_tokens" in options:
        chunks = -(-hidden.shape[0] * hidden.shape[1] // options["chunk_tokens"])
    gathers = ["all_gather"] * ((1 if sequence_parallel else 0) + (chunks if mode == "chunked" else 1))
    if size == 1:
        assert forward_calls.calls == [] and backward_calls.calls == [], (forward_calls.calls, backward_calls.calls)
    elif mode == "chunked":
        assert forward_calls.calls[:len(gathers)] == gathers, forward_calls.calls
        assert forward_calls.calls[len(gathers):] in reductions, forward_calls.calls
        assert backward_calls.calls == [], backward_calls.calls
    else:
        assert forward_calls.calls == gathers, forward_calls.calls
        regather = ["all_gather"] if sequence_parallel else []
        assert backward_calls.calls in [regather + r for r in reductions], backward_calls.calls

    not_loss = ("vocab_range", "gradient_accumulation_fusion", "token_block", "vocab_block", "chunk_tokens")
    loss_options = {k: v for k, v in options.items() if k not in not_loss}
    want = reference(hidden, weight, bias, target, grad_loss, label_smoothing, reduction=reduction, **loss_options)
    want_hidden = want[1][rank * tokens:(rank + 1) * tokens] if sequence_parallel else want[1]
    grad_weight = w.main_grad if main_grad else w.grad
    if main_grad:
        assert w.grad is None
    got = (loss.detach(), h.grad, grad_weight, b.grad)
    expected = (want[0], want_hidden, want[2][begin:end], want[3][begin:end])
    if dtype == torch.float32:
        check_fp32(got, expected)
    else:
        assert close(got[0], expected[0], 1e-5)
        for g, r in zip(got[1:], expected[1:]):
            assert g.dtype == dtype and close(g, r, 2.0**-7)
    # Every rank holds the bit-identical loss.
    losses = [torch.empty_like(loss) for _ in range(size)]
    dist.all_gather(losses, loss.detach().contiguous(), group=group)
    assert all(torch.equal(other, losses[0]) for other in losses)


GROUP_CASES = [
    {},
    {"label_smoothing": 0.1, "reduction": "mean"},
    {"mode": "chunked", "reduction": "mean", "label_smoothing": 0.1},
    {"mode": "chunked", "reduction": "sum", "options": {"z_loss_weight": 1e-3, "softcap": 4.0}},
    {"uneven": True, "label_smoothing": 0.1, "options": {"smoothing_semantics": "pytorch", "ignore_index": 2}},
    {"uneven": True, "mode": "chunked", "reduction": "mean"},
    {"sequence_parallel": True, "label_smoothing": 0.1},
    {"sequence_parallel": True, "mode": "chunked", "reduction": "mean"},
    {"sequence_parallel": True, "uneven": True, "reduction": "sum", "options": {"logit_scale": 0.5}},
    {"main_grad": True, "reduction": "mean"},
    {"main_grad": True, "mode": "chunked", "reduction": "sum", "sequence_parallel": True},
    {"dtype": torch.bfloat16, "label_smoothing": 0.1},
    {"dtype": torch.bfloat16, "mode": "chunked", "reduction": "mean", "sequence_parallel": True},
    {"options": {"token_block": 4, "vocab_block": 8, "chunk_tokens": 4}, "mode": "chunked", "reduction": "mean"},
]


def group_worker(rank, size, init_file):
    group = init_group(rank, size, init_file)
    for case in GROUP_CASES:
        try:
            check_group_case(group, rank, size, **case)
        except Exception as error:
            raise AssertionError(f"rank {rank} of {size}, case {case}: {error}") from error
    if size > 1:
        check_one_rank_fails(group, rank, size)
        check_the_dlpack_collectives(group, rank, size)
    dist.destroy_process_group()


def check_the_dlpack_collectives(group, rank, size):
    # vpce._vpce's all_reduce_hidden_gradient through a Python all_gather on the group:
    # every rank's part summed in rank order, the same bits everywhere; the chunked forward
    # returns its number of all-gathers, one per chunk.
    from vpce._torch_collective import _Collective, _GroupCall

    generator = torch.Generator().manual_seed(100 + rank)
    part = torch.randn(6, 5, generator=generator)
    parts = [torch.empty_like(part) for _ in range(size)]
    dist.all_gather(parts, part, group=group)
    g = part.clone()
    with _GroupCall(group) as call:
        vpce._vpce.all_reduce_hidden_gradient(g, rank=rank, size=size, all_gather=_Collective(call, rank, size))
    want = parts[0].clone()
    for other in parts[1:]:
        want += other
    assert torch.equal(g, want)
    hidden, weight, _, target = problem(seed=5, shape=(10,), vocab=8 * size)
    options = vpce.LossOptions()
    options.reduction = vpce.Reduction.SUM
    head = vpce._vpce.HeadOptions()
    head.token_block, head.chunk_tokens = 2, 4
    loss, lse = torch.empty(()), torch.empty(10)
    grad = torch.empty(8, weight.shape[1])
    with _GroupCall(group) as call:
        gathers = vpce._vpce.linear_cross_entropy_forward_backward(
            hidden, weight[rank * 8:(rank + 1) * 8], None, target, rank * 8, (rank + 1) * 8, 8 * size, options, head,
            1.0, loss, lse, grad_weight=grad, rank=rank, size=size, all_gather=_Collective(call, rank, size))
    assert gathers == 3  # 10 tokens in chunks of 4
    want = reference(hidden, weight, None, target, None, reduction="sum")
    assert relative_error(loss, want[0]) < 1e-6 and relative_error(grad, want[2][rank * 8:(rank + 1) * 8]) < 1e-5


def check_one_rank_fails(group, rank, size):
    # A rank that fails before the gathers (a bad option; its hidden states' gather, with
    # sequence parallelism, or the loss's) gives every rank its error, at once.
    hidden, weight, _, target = problem(seed=3, shape=(4 * size, 2), vocab=8 * size)
    w = weight[rank * 8:(rank + 1) * 8]
    for sequence_parallel in (False, True):
        for mode, reduction in (("recompute", "none"), ("chunked", "sum")):
            h = hidden[rank * 4:(rank + 1) * 4] if sequence_parallel else hidden
            options = {"mode": mode, "reduction": reduction}
            if rank == size - 1:
                options["colour"] = "red"
            outcome = same_outcome_on_every_rank(group, size, lambda: vt.linear_cross_entropy(
                h, w, target, 0.0, group, sequence_parallel=sequence_parallel, **options))
            assert outcome[0] == "TypeError" and outcome[1].startswith(f"rank {size - 1} of {size}: "), outcome
            assert "unexpected options ['colour']" in outcome[1], outcome
    # Ranks that disagree on the vocabulary (rank 0 claims one row more) all get vpce's error.
    rows = 8 + (1 if rank == 0 else 0)
    outcome = same_outcome_on_every_rank(group, size, lambda: vt.linear_cross_entropy(
        hidden, weight[:rows], target, 0.0, group))
    assert outcome[0] == "Error", outcome
    # Ranks that disagree on whether hidden's gradient is wanted (only then does a backward
    # all-reduce it): the forward's gather refuses it on every rank, rather than one rank's
    # backward (or, chunked, its forward) waiting in an all-reduce the others never make.
    for mode, reduction in (("recompute", "none"), ("chunked", "sum")):
        h = hidden.clone().requires_grad_(rank != size - 1)
        outcome = same_outcome_on_every_rank(group, size, lambda: vt.linear_cross_entropy(
            h, w, target, 0.0, group, mode=mode, reduction=reduction))
        assert outcome[0] == "Error" and "ranks disagree on whether hidden's gradient is wanted" in outcome[1], outcome
    # A bad weight.main_grad on one rank (gradient_accumulation_fusion) is found in the forward,
    # before the gathers, so every rank gets its error there: in the backward that rank would
    # have raised alone and left the others in the hidden gradient's all-reduce (a hang until
    # the group's timeout), and the chunked mode's forward would have failed on it alone.
    for sequence_parallel in (False, True):
        for mode, reduction in (("recompute", "sum"), ("chunked", "sum")):
            h = (hidden[rank * 4:(rank + 1) * 4] if sequence_parallel else hidden).clone().requires_grad_()
            wr = w.clone().requires_grad_()
            wr.main_grad = torch.zeros(8, w.shape[1] + (1 if rank == size - 1 else 0))

            def step():
                loss = vt.linear_cross_entropy(h, wr, target, 0.0, group, sequence_parallel=sequence_parallel,
                                               mode=mode, reduction=reduction, gradient_accumulation_fusion=True)
                loss.backward()

            outcome = same_outcome_on_every_rank(group, size, step)
            assert outcome[0] == "ValueError" and "weight.main_grad: expected a tensor of the weight's shape" in \
                outcome[1], outcome


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gloo_group(size):
    spawn(group_worker, size)


# ---- the real megatron-core (when installed: PyTorch >= 2.6) -------------------------------

def output_layer_and_loss(model, hidden_states, labels, output_weight=None, mode="recompute"):
    """docs/python.md's replacement of GPTModel's output_layer + compute_language_model_loss."""
    from megatron.core import parallel_state  # noqa: PLC0415

    layer = model.output_layer
    weight = output_weight if output_weight is not None else layer.weight
    loss = vt.linear_cross_entropy(
        hidden_states, weight, labels.transpose(0, 1).contiguous(),
        tp_group=parallel_state.get_tensor_model_parallel_group(), bias=layer.bias,
        sequence_parallel=layer.sequence_parallel, gradient_accumulation_fusion=layer.gradient_accumulation_fusion,
        mode=mode, reduction="none" if mode == "recompute" else "sum")
    return loss.transpose(0, 1).contiguous() if mode == "recompute" else loss


def megatron_worker(rank, size, init_file):
    # Megatron's own output layer (a ColumnParallelLinear on this rank's rows) and its
    # vocab_parallel_cross_entropy, as GPTModel runs them, against the docs' replacement on
    # the same weights: the per-token loss [b, s], the gradients of the hidden states and of
    # this rank's weight rows; tied weights (output_weight) too; the chunked mode's sum.
    from types import SimpleNamespace  # noqa: PLC0415

    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415
    from test_megatron_core import megatron_init  # noqa: PLC0415

    megatron_init(rank, size, init_file)
    torch.manual_seed(0)  # the same weights on every rank before the layer takes its rows
    config = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=size, params_dtype=torch.float32)
    layer = ColumnParallelLinear(24, 4 * 37, config=config, init_method=torch.nn.init.normal_, bias=False,
                                 gather_output=False, skip_bias_add=False)
    model = SimpleNamespace(output_layer=layer)
    generator = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(8, 2, 24, generator=generator)  # [s, b, H]
    labels = torch.randint(0, 4 * 37, (2, 8), generator=generator)  # [b, s]
    loss_mask = (torch.rand(2, 8, generator=generator) > 0.2).float()
    # Megatron: GPTModel's output_layer, then compute_language_model_loss.
    h_megatron = hidden_states.clone().requires_grad_()
    logits, _ = layer(h_megatron)
    want = vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous()).transpose(0, 1)
    (want * loss_mask).sum().backward()
    want_weight_grad = layer.weight.grad.clone()
    for tied in (False, True):
        layer.weight.grad = None
        tied_weight = layer.weight.detach().clone().requires_grad_() if tied else None
        h = hidden_states.clone().requires_grad_()
        loss = output_layer_and_loss(model, h, labels, output_weight=tied_weight)
        (loss * loss_mask).sum().backward()
        weight_grad = tied_weight.grad if tied else layer.weight.grad
        assert loss.shape == want.shape and relative_error(loss.detach(), want.detach()) < 1e-6
        assert relative_error(h.grad, h_megatron.grad) < 1e-5
        assert relative_error(weight_grad, want_weight_grad) < 1e-5
    # The chunked mode: the masked tokens' labels ignored, the loss summed.
    layer.weight.grad = None
    h = hidden_states.clone().requires_grad_()
    loss = output_layer_and_loss(model, h, labels.masked_fill(loss_mask == 0, -100), mode="chunked")
    loss.backward()
    assert relative_error(loss.detach(), (want * loss_mask).sum().detach()) < 1e-6
    assert relative_error(h.grad, h_megatron.grad) < 1e-5
    assert relative_error(layer.weight.grad, want_weight_grad) < 1e-5
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [1, 2])
def test_against_megatron_cores_output_layer_and_loss(size):
    pytest.importorskip("megatron.core", reason="megatron-core (needs PyTorch >= 2.6) is not installed")
    spawn(megatron_worker, size)
