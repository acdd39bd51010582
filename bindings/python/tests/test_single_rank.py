"""vpce's Python package on one rank: vpce.torch against PyTorch's float64 F.cross_entropy,
gradcheck, bf16, in place, the loss options and errors."""
import os

import pytest
import torch

import vpce
import vpce.torch as vt
from reference import loss_and_grad, megatron_legacy, relative_error

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


@pytest.mark.parametrize("offset", [1e2, 1e4, -1e4, 1e5])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_large_logits_keep_the_gradients_fp32_accuracy(offset, label_smoothing):
    """The lse saved for the backward is float64: exp(z - lse) keeps fp32's accuracy at any
    size of the logits (a float32 lse put 1.3e-4 into the gradient at 1e4, where PyTorch's
    own fp32 F.cross_entropy keeps 1e-7)."""
    logits, target, grad_loss = problem()
    logits = (logits.double() + offset).float()
    loss, grad = run(logits, target, grad_loss, label_smoothing)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=label_smoothing)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def test_pytorch_smoothing_of_one_matches_f_cross_entropy():
    """F.cross_entropy takes label_smoothing=1 (every class weighted 1/V); so does vpce with
    PyTorch's semantics (Megatron's stays in [0, 1))."""
    logits, target, grad_loss = problem()
    x = logits.clone().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(x, target, 1.0, smoothing_semantics="pytorch")
    loss.backward(grad_loss)
    full = logits.double().requires_grad_()
    want = torch.nn.functional.cross_entropy(full.flatten(0, -2), target.flatten(), label_smoothing=1.0,
                                             reduction="none").view(target.shape)
    (want_grad,) = torch.autograd.grad(want, full, grad_loss.double())
    assert relative_error(loss, want.detach()) < 1e-6
    assert relative_error(x.grad, want_grad) < 1e-6
    with pytest.raises(vpce.Error, match=r"options.label_smoothing: expected a value in \[0, 1\), got 1"):
        vt.vocab_parallel_cross_entropy(logits.clone(), target, 1.0)


@pytest.mark.parametrize("inplace", [False, True])
def test_double_backward_raises_rather_than_giving_a_wrong_second_derivative(inplace):
    """The in-place gradient overwrote a tensor in the graph, and a gradient penalty's
    second derivative came out silently wrong; both paths now refuse create_graph=True."""
    logits, target, _ = problem()
    x = logits.clone().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(x * 2.0, target, 0.1, inplace_backward=inplace)
    with pytest.raises(RuntimeError, match="expected a first derivative only"):
        torch.autograd.grad(loss.sum(), x, create_graph=True)


@pytest.mark.parametrize("options", [{"z_loss_weight": True}, {"ignore_index": torch.tensor(True)},
                                     {"ignore_index": True}])
def test_bools_are_not_numbers_here(options):
    logits, target, _ = problem()
    with pytest.raises(TypeError, match="expected a"):
        vt.vocab_parallel_cross_entropy(logits.clone(), target, 0.0, **options)
    with pytest.raises(TypeError, match="label_smoothing: expected a number, got bool"):
        vt.vocab_parallel_cross_entropy(logits.clone(), target, True, smoothing_semantics="pytorch")


@pytest.mark.parametrize("seed", range(40))
def test_bf16_within_bf16_rounding(seed):
    torch.manual_seed(seed)  # (the module's generator depends on which tests ran before)
    logits, target, grad_loss = problem(dtype=torch.bfloat16)
    loss, grad = run(logits, target, grad_loss, 0.1)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=0.1)
    assert grad.dtype == torch.bfloat16
    assert relative_error(loss, want_loss) < 1e-6  # the math is fp32 on the bf16 values
    # Each gradient element g (p - q) is rounded once to bf16, half an ulp (2^-9 relative),
    # after fp32's error in g p, which the fp32 lse (|lse| 2^-24 relative in p, |lse| < 30
    # here) dominates: where p and the smoothing's q nearly cancel, that is more than the
    # rounding (2^-8 |g (p - q)| alone failed on 34 of 200 seeds, by up to 1.02x).
    p = torch.softmax(logits.double(), dim=-1)
    fp32_error = grad_loss.double().unsqueeze(-1) * p * 30 * 2.0**-24
    assert ((grad.double() - want_grad).abs() <= want_grad.abs() * 2.0**-8 + 2 * fp32_error).all()


def test_large_new_gradient_on_huge_pages_matches_reference():
    # 64 MiB of fp32 logits: the backward's new gradient is advised onto huge pages first.
    logits, target, grad_loss = problem(shape=(512,), vocab=32768, scale=2.0)
    loss, grad = run(logits, target, grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def mappings():
    """(start, end, name) of this process's memory mappings (Linux's /proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(a, 16) for a in fields[0].split("-"))
            out.append((start, end, fields[5] if len(fields) > 5 else ""))
    return out


def mapping_of(address):
    return next(((s, e, n) for s, e, n in mappings() if s <= address < e), None)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_new_gradients_are_mappings_of_their_own_reused_once_freed_and_bounded():
    # A training loop's out-of-place gradient, once per step: a mapping of its own on 2 MiB
    # boundaries, never in glibc's heap (where a new 6 MiB buffer per step left resident holes
    # and huge-page advice once glibc's mmap threshold had risen after the first free); the
    # one freed last is the next one of its size (resident pages, no faults; earlier tests may
    # have left others of that size, 512 x 4096 bf16 gradients among them); one alive is never
    # handed out twice; at most 64 MiB kept; one of 32 MiB or more unmapped when freed.
    logits = torch.zeros(256, 4096)  # 4 MiB
    first = None
    for step in range(4):
        grad = vt._new_gradient(logits)
        address = grad.data_ptr()
        first = address if first is None else first
        assert address % (2 << 20) == 0 and address == first, step
        region = mapping_of(address)
        assert region is not None and region[2] != "[heap]", (step, region)
        grad.fill_(float(step))
        assert float(grad.sum()) == step * grad.numel()
        del grad
    alive = [vt._new_gradient(logits) for _ in range(20)]
    starts = sorted(g.data_ptr() for g in alive)
    assert all(b - a >= 4 << 20 for a, b in zip(starts, starts[1:])), "two live gradients overlap"
    for number, g in enumerate(alive):
        g.fill_(float(number))
    assert [float(g[0, 0]) for g in alive] == [float(n) for n in range(20)]
    del alive, g
    kept, kept_bytes = vpce._vpce.kept_gradient_buffers()
    assert 0 < kept_bytes <= 64 << 20 and kept == 10, (kept, kept_bytes)  # 6 MiB mapped for each
    still_mapped = [a for a in starts if mapping_of(a) is not None]
    assert len(still_mapped) == 10, len(still_mapped)
    large = vt._new_gradient(torch.zeros(8192, 1024))  # 32 MiB
    address = large.data_ptr()
    del large
    assert mapping_of(address) is None
    with pytest.raises(ValueError, match="bytes: expected a size > 0, got 0"):
        vpce._vpce.gradient_buffer(0)


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
    with pytest.raises(ValueError, match=r"target.shape: expected the logits' leading shape \(7, 3\)"):
        vt.vocab_parallel_cross_entropy(logits, target[:2] % 50)
    # [b, s] labels with [s, b, V] logits (the transpose forgotten): as many elements, the
    # wrong tokens; refused, as Megatron refuses it.
    for call in (vt.vocab_parallel_cross_entropy, vt._VocabParallelCrossEntropy.apply, vt.unfused_cross_entropy):
        with pytest.raises(ValueError, match=r"target.shape: .*got \(3, 7\)"):
            call(logits, (target % 50).T)


def test_group_of_several_ranks_needs_a_collective():
    logits, target, _ = problem(vocab=10)
    loss = torch.empty(target.shape)
    with pytest.raises(vpce.Error, match="all_gather: expected a callable"):
        vpce.forward(logits, target, 0, 10, 20, vpce.LossOptions(), loss, torch.empty(target.shape), rank=0, size=2)


def pytorch_loss_and_grad(base, make_logits, target, grad_loss):
    """float64 loss and gradient with respect to `base` of F.cross_entropy on
    make_logits(base): the reference for logits that are a view (expanded, overlapping)."""
    full = base.detach().double().requires_grad_()
    logits = make_logits(full)
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none")
    (grad,) = torch.autograd.grad(loss, full, grad_loss.double().reshape(-1))
    return loss.detach().view(target.shape), grad


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("layout", ["expanded rows", "expanded inner rows", "overlapping rows"])
def test_expanded_and_overlapping_logits_are_copied(layout, inplace):
    # Views that PyTorch's own ops read by copying: vpce.torch copies them too (and writes an
    # in-place gradient into that copy, never into the expanded tensor).
    make, base = {
        "expanded rows": (lambda b: b.expand(12, 10), torch.randn(1, 10)),
        "expanded inner rows": (lambda b: b.expand(4, 3, 10), torch.randn(4, 1, 10)),
        "overlapping rows": (lambda b: b.as_strided((12, 10), (5, 1)), torch.randn(70)),
    }[layout]
    shape = make(base).shape[:-1]
    target = torch.randint(0, 10, shape)
    grad_loss = torch.rand(shape) + 0.5
    want_loss, want_grad = pytorch_loss_and_grad(base, make, target, grad_loss)
    leaf = base.clone().requires_grad_()
    loss = vt.vocab_parallel_cross_entropy(make(leaf * 1), target, inplace_backward=inplace)
    loss.backward(grad_loss)
    assert relative_error(loss.detach(), want_loss) < 1e-6
    assert relative_error(leaf.grad, want_grad) < 1e-6


@pytest.mark.parametrize("layout", ["transposed", "expanded", "strided"])
def test_transposed_expanded_and_strided_targets_are_copied(layout):
    logits, _, grad_loss = problem(shape=(4, 3), vocab=20)
    target = {
        "transposed": torch.randint(0, 20, (3, 4)).t(),
        "expanded": torch.randint(0, 20, (1, 3)).expand(4, 3),
        "strided": torch.randint(0, 20, (4, 6))[:, ::2],
    }[layout]
    loss, grad = run(logits, target, grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target.contiguous(), grad_loss)
    assert relative_error(loss, want_loss) < 1e-6 and relative_error(grad, want_grad) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.float64, torch.float16])
def test_float_and_bool_targets_are_refused(dtype):
    logits, target, _ = problem(vocab=20)
    bad = (target % 20).to(dtype) + 0.99 if dtype.is_floating_point else target > 5
    with pytest.raises(TypeError, match=rf"target\.dtype: expected int32 or int64.*got {dtype}"):
        vt.vocab_parallel_cross_entropy(logits, bad)
    if dtype == torch.float32:
        with pytest.raises(TypeError, match="target.dtype"):
            vt.vocab_parallel_cross_entropy(logits, torch.full(target.shape, float("nan")))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_integer_targets_are_widened(dtype):
    logits, target, grad_loss = problem(vocab=100)
    loss, grad = run(logits, target.to(dtype), grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    assert relative_error(loss, want_loss) < 1e-6 and relative_error(grad, want_grad) < 1e-6


def in_place_problem():
    logits, target, grad_loss = problem(vocab=50)
    x = logits.clone().requires_grad_()
    return x, x * 1, target % 50, grad_loss


def test_in_place_second_backward_raises():
    x, y, target, grad_loss = in_place_problem()
    loss = vt.vocab_parallel_cross_entropy(y, target, inplace_backward=True)
    loss.backward(grad_loss, retain_graph=True)
    want_loss, want_grad = loss_and_grad(x, target, grad_loss)
    assert relative_error(x.grad, want_grad) < 1e-6
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(grad_loss)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_in_place_into_a_copy_second_backward_raises(dtype):
    # float64 logits, and transposed ones, are copied: the gradient overwrites the copy, which
    # the graph saved, so a second backward must raise too.
    x, _, target, grad_loss = in_place_problem()
    y = x.to(dtype) * 1 if dtype == torch.float64 else (x * 1).transpose(0, 1).contiguous().transpose(0, 1)
    loss = vt.vocab_parallel_cross_entropy(y, target, inplace_backward=True)
    loss.backward(grad_loss, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(grad_loss)


@pytest.mark.parametrize("square_first", [True, False])
def test_in_place_with_another_op_that_saved_the_logits_raises_or_is_right(square_first):
    # (y ** 2) saves y for its backward; the in-place gradient overwrites y. PyTorch's rule:
    # that backward raises (unless it runs before the write: then it is right).
    x, y, target, grad_loss = in_place_problem()
    square = (y**2).sum() if square_first else None
    loss = vt.vocab_parallel_cross_entropy(y, target, inplace_backward=True)
    total = (loss * grad_loss).sum() + (square if square_first else (y**2).sum())
    try:
        total.backward()
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
        return
    _, want_grad = loss_and_grad(x, target, grad_loss)
    assert relative_error(x.grad, want_grad + 2 * x.detach().double()) < 1e-6


@pytest.mark.parametrize("view", [False, True])
def test_in_place_on_a_leaf_that_requires_grad_is_refused(view):
    logits, target, _ = problem(vocab=50)
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="inplace_backward: expected logits that autograd lets be overwritten.*"
                                         + ("a view of a leaf" if view else "got a leaf")):
        vt.vocab_parallel_cross_entropy(leaf[:, :, :25] if view else leaf, target % 25, inplace_backward=True)


def test_a_label_smoothing_tensor_that_requires_grad_is_refused_rather_than_left_without_one():
    """vpce gives label_smoothing no gradient: a tensor that requires one is refused (the loss
    required grad and the tensor's .grad stayed None); one that does not is taken as its value."""
    logits, target, _ = problem(vocab=50)
    wanting = torch.tensor(0.1, requires_grad=True)
    for call in (lambda a: vt.vocab_parallel_cross_entropy(logits, target % 50, a),
                 lambda a: vt.linear_cross_entropy(torch.randn(3, 8), torch.randn(50, 8), target.flatten()[:3] % 50, a)):
        with pytest.raises(ValueError, match="label_smoothing: expected a number or a tensor that does not require "
                                             "grad"):
            call(wanting)
    got = vt.vocab_parallel_cross_entropy(logits, target % 50, torch.tensor(0.1))
    assert torch.equal(got, vt.vocab_parallel_cross_entropy(logits, target % 50, 0.1))


@pytest.mark.parametrize("value", [1.5, -0.5, float("nan"), 1.0])
def test_legacy_smoothing_outside_its_range_is_refused(value):
    logits, target, _ = problem(vocab=50)
    with pytest.raises(ValueError, match=r"label_smoothing: expected a value in \[0, 1\), got"):
        vt.vocab_parallel_cross_entropy(logits, target % 50, value, megatron_legacy_label_smoothing=True)


def test_legacy_smoothing_needs_two_columns():
    logits, target, _ = problem(vocab=1)
    with pytest.raises(vpce.Error, match=r"shard's valid columns: expected >= 2 when Megatron's legacy label "
                                         r"smoothing is used .*, got 1"):
        vt.vocab_parallel_cross_entropy(logits, target * 0, 0.1, megatron_legacy_label_smoothing=True)
    loss = vt.vocab_parallel_cross_entropy(logits, target * 0, 0.0, megatron_legacy_label_smoothing=True)
    assert (loss.abs() < 1e-6).all()  # one class, no smoothing: the plain loss, log(1)


def test_legacy_smoothing_ignores_ignored_tokens():
    logits, target, grad_loss = problem(vocab=50)
    target %= 50
    target[0, :] = -100
    target[4, 2] = -100
    ignored = target == -100
    loss, grad = run(logits, target, grad_loss, 0.1, megatron_legacy_label_smoothing=True)
    want_loss, want_grad = megatron_legacy(logits, target.masked_fill(ignored, 0), 0, 50, grad_loss, 0.1)
    assert (loss[ignored] == 0).all() and (grad[ignored] == 0).all()
    assert relative_error(loss[~ignored], want_loss[~ignored]) < 1e-6
    assert relative_error(grad[~ignored], want_grad[~ignored]) < 1e-6


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e6])
def test_legacy_smoothing_keeps_its_accuracy_at_large_logits(offset):
    """The shard's mean log-probability in fp64 (an fp32 mean minus the lse cancelled: 8e-6
    of the loss at 1e4, 6e-4 at 1e6, where Megatron's own fp32 keeps 7e-8)."""
    logits, target, grad_loss = problem(shape=(300,), vocab=1000)
    logits = (logits.double() + offset).float()
    loss, grad = run(logits, target, grad_loss, 0.1, megatron_legacy_label_smoothing=True)
    want_loss, want_grad = megatron_legacy(logits, target, 0, 1000, grad_loss, 0.1)
    assert relative_error(loss, want_loss) < 1e-6
    assert relative_error(grad, want_grad) < 1e-6


def test_float64_beyond_float32s_range_is_refused():
    """float64 is computed in float32; a finite value beyond its range would become inf and
    every result NaN, so it is refused by name (the loss, and each of the head's operands)."""
    logits = torch.tensor([[1e39, 0.0, -1.0], [5e38, 5e38, 0.0]], dtype=torch.float64)
    target = torch.tensor([0, 2])
    with pytest.raises(ValueError, match=r"vocab_parallel_logits: expected float64 values within float32's range "
                                         r".*got one of magnitude 1e\+39"):
        vt.vocab_parallel_cross_entropy(logits, target)
    hidden, weight = torch.ones(2, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    for name in ("hidden", "weight", "bias"):
        args = {"hidden": hidden, "weight": weight, "bias": torch.zeros(3, dtype=torch.float64)}
        args[name] = args[name].clone()
        args[name].view(-1)[1] = 4e38
        with pytest.raises(ValueError, match=fr"{name}: expected float64 values within float32's range"):
            vt.linear_cross_entropy(args["hidden"], args["weight"], target, bias=args["bias"])
    # infinities themselves are not refused: they stay what they are (the loss NaN or inf)
    assert torch.isnan(vt.vocab_parallel_cross_entropy(torch.tensor([[float("inf"), 0.0]], dtype=torch.float64),
                                                       torch.tensor([1]))).all()


@pytest.mark.parametrize("logits, error, fragment", [
    (torch.tensor(1.0), ValueError, r"vocab_parallel_logits\.dim\(\): expected 1 to 8 dimensions.*got 0"),
    (torch.zeros([1] * 9 + [4]), ValueError, r"vocab_parallel_logits\.dim\(\): expected 1 to 8 dimensions.*got 10"),
    (torch.zeros(3, 4, dtype=torch.bool), TypeError,
     r"vocab_parallel_logits\.dtype: expected float32, bfloat16, float16 or float64, got torch\.bool"),
    (torch.zeros(3, 4, dtype=torch.int32), TypeError, r"vocab_parallel_logits\.dtype: .* got torch\.int32"),
    (torch.zeros(3, 4, device="meta"), ValueError, r"vocab_parallel_logits\.device: expected cpu or cuda, got meta"),
    (torch.zeros(3, 4).to_sparse(), TypeError,
     r"vocab_parallel_logits\.layout: expected torch\.strided \(a dense tensor\), got torch\.sparse_coo"),
])
def test_bad_logits_name_the_argument(logits, error, fragment):
    target = torch.zeros(logits.shape[:-1], dtype=torch.long)
    with pytest.raises(error, match=fragment):
        vt.vocab_parallel_cross_entropy(logits, target)


@pytest.mark.parametrize("name, value, error, fragment", [
    ("ignore_index", 2**70, ValueError, r"options\.ignore_index: expected an integer in \[-9223372036854775808, "
                                        r"9223372036854775807\], got 1180591620717411303424"),
    ("num_threads", 2**40, ValueError, r"options\.num_threads: expected an integer in \[-2147483648, 2147483647\], "
                                       r"got 1099511627776"),
    ("ignore_index", "x", TypeError, r"options\.ignore_index: expected an integer, got str 'x'"),
    ("num_threads", 1.5, TypeError, r"options\.num_threads: expected an integer, got float 1\.5"),
    ("z_loss_weight", "big", TypeError, r"options\.z_loss_weight: expected a number, got str 'big'"),
    ("smoothing_semantics", ["pytorch"], ValueError, r"smoothing_semantics: expected 'megatron', 'pytorch' or 'megatron_legacy', got"),
])
def test_options_of_the_wrong_type_or_range_name_the_option(name, value, error, fragment):
    logits, target, _ = problem(vocab=50)
    with pytest.raises(error, match=fragment):
        vt.vocab_parallel_cross_entropy(logits, target % 50, **{name: value})


def test_raw_api_names_tensors_it_cannot_import():
    logits, target, _ = problem(vocab=10)
    loss, lse = torch.empty(target.shape), torch.empty(target.shape)
    for bad, fragment in [(logits > 0, "dtype torch.bool"), (logits.to("meta"), "device meta"),
                          (logits.to_sparse(), "layout torch.sparse_coo")]:
        try:
            bad.__dlpack__()
        except Exception:  # noqa: BLE001 (what PyTorch refuses to export, nanobind cannot import)
            with pytest.raises(TypeError, match=rf"^logits: expected an array that exports through DLPack.*got a "
                                                rf"torch\.Tensor \(.*{fragment}.*\) whose DLPack export fails"):
                vpce.forward(bad, target, 0, 10, 10, vpce.LossOptions(), loss, lse)
        else:  # newer PyTorch exports bool through DLPack: then vpce itself refuses the dtype
            with pytest.raises(vpce.Error, match=r"logits\.dtype: expected float32, bfloat16 or float16, got bool"):
                vpce.forward(bad, target, 0, 10, 10, vpce.LossOptions(), loss, lse)
