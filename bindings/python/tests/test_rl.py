"""vpce.torch.log_probs_and_entropy, linear_log_probs_and_entropy and linear_policy_objective
(the fused head's two modes) and the RL drop-ins (vpce.verl, vpce.nemo_rl) against a float64
reference built from PyTorch's own operations (log_softmax of the logits / T over the whole
vocabulary, the entropy -sum p log p, autograd's gradient of g_lp log p_y + g_H H with
non-uniform upstream gradients): fp32 within 1e-6 (outputs) and 1e-5 (gradients), bf16 within
its rounding; per-token and scalar temperatures, ignored tokens, padded vocabularies, a
keep-mask as -inf logits, on one rank and on gloo groups of 2 and 3 processes, the collectives
counted (one all-gather per forward, none in the backward on logits, the hidden gradient's
all-reduce in the head), the same outputs on every rank, a rank's bad argument raised on every
rank; against verl 0.9.1's own functions on the same inputs (where megatron-core and verl are
installed); the custom ops under torch.compile(fullgraph=True) and opcheck (PyTorch >= 2.4)."""
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

import vpce.torch as vt
from vpce import nemo_rl as vnemo
from vpce import verl as vverl
from test_distributed import init_group, spawn
from test_linear_cross_entropy import CollectiveCounter

needs_custom_ops = pytest.mark.skipif(not vt._CUSTOM_OPS, reason="torch.library.custom_op needs PyTorch >= 2.4")


def reference(logits, target, temperature, g_lp, g_h, valid=None, ignore_index=-100):
    """(log_prob, entropy, grad) in float64 from PyTorch's operations on the whole vocabulary."""
    x = logits.detach().double().requires_grad_(True)
    t = temperature.double() if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature)).double()
    while t.dim() < target.dim():
        t = t.unsqueeze(-1)
    z = x[..., :valid] / t.unsqueeze(-1)
    log_p = torch.log_softmax(z, dim=-1)
    kept = target != ignore_index
    safe = torch.where(kept, target, torch.zeros_like(target))
    log_prob = torch.where(kept, log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros_like(z[..., 0]))
    entropy = torch.where(kept, -(log_p.exp() * log_p).sum(-1), torch.zeros_like(z[..., 0]))
    (log_prob * g_lp.double() + entropy * g_h.double()).sum().backward()
    return log_prob.detach(), entropy.detach(), x.grad


def upstream(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator) * 2 - 0.5


def check(log_prob, entropy, grad, want, grad_tolerance=1e-5):
    want_lp, want_h, want_grad = want
    assert (log_prob.double() - want_lp).abs().max() <= 1e-6 * max(1.0, want_lp.abs().max().item())
    assert (entropy.double() - want_h).abs().max() <= 1e-6 * max(1.0, want_h.abs().max().item())
    assert (grad.double() - want_grad).abs().max() <= grad_tolerance * want_grad.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_one_rank_matches_float64(dtype, per_token):
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 11, 1009, generator=generator) * 3).to(dtype).requires_grad_(True)
    target = torch.randint(0, 1009, (3, 11), generator=generator)
    target[0, :4] = -100
    temperature = torch.tensor([0.5, 1.0, 1.7])[torch.arange(33) % 3].view(3, 11) if per_token else 0.7
    g_lp, g_h = upstream((3, 11), 1), upstream((3, 11), 2)
    log_prob, entropy = vt.log_probs_and_entropy(logits, target, temperature=temperature)
    (log_prob * g_lp + entropy * g_h).sum().backward()
    assert log_prob.dtype == torch.float32 and entropy.dtype == torch.float32
    assert torch.all(log_prob[0, :4] == 0) and torch.all(entropy[0, :4] == 0)
    assert torch.all(logits.grad[0, :4] == 0)
    check(log_prob, entropy, logits.grad, reference(logits, target, temperature, g_lp, g_h),
          1e-5 if dtype == torch.float32 else 4e-3)


def test_one_rank_in_place_and_options():
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(40, 520, generator=generator) * 2
    base[:, 500:] = 50.0  # padding that would dominate if it leaked
    target = torch.randint(0, 500, (40,), generator=generator)
    g_lp, g_h = upstream((40,), 3), upstream((40,), 4)
    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1.0  # not a leaf: the in-place gradient may overwrite it
    log_prob, entropy = vt.log_probs_and_entropy(logits, target, temperature=1.3, inplace_backward=True,
                                                 valid_vocab_size=500)
    (log_prob * g_lp + entropy * g_h).sum().backward()
    check(log_prob, entropy, leaf.grad, reference(base, target, 1.3, g_lp, g_h, valid=500))
    assert torch.all(leaf.grad[:, 500:] == 0)


def test_keep_mask_as_minus_infinity_renormalises_over_the_support():
    """The rollout's top-k support (k = 5) applied in place to the trainer's logits (a non-leaf
    output, as a model's): log-prob and entropy over the support, no gradient outside it."""
    generator = torch.Generator().manual_seed(9)
    leaf = (torch.randn(4, 9, 700, generator=generator) * 3).requires_grad_(True)
    logits = leaf * 1.0
    top = logits.detach().topk(5, dim=-1).indices
    keep = torch.zeros(logits.shape, dtype=torch.bool).scatter_(-1, top, True)
    target = top.gather(-1, torch.randint(0, 5, (4, 9, 1), generator=generator)).squeeze(-1)
    logits.masked_fill_(~keep, float("-inf"))  # no copy of the logits
    g_lp, g_h = upstream((4, 9), 5), upstream((4, 9), 6)
    log_prob, entropy = vt.log_probs_and_entropy(logits, target, temperature=0.7)
    (log_prob * g_lp + entropy * g_h).sum().backward()
    x = leaf.detach().double().requires_grad_(True)
    log_p = torch.log_softmax(x.masked_fill(~keep, float("-inf")) / 0.7, dim=-1)
    want_lp = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    want_h = -(log_p.exp() * log_p.masked_fill(~keep, 0.0)).sum(-1)  # (0 log 0 = 0, and so its gradient)
    (want_lp * g_lp.double() + want_h * g_h.double()).sum().backward()
    check(log_prob, entropy, leaf.grad, (want_lp.detach(), want_h.detach(), x.grad))
    assert torch.all(leaf.grad[~keep] == 0)


def test_one_rank_edge_rows():
    logits = torch.zeros(4, 300)
    logits[0, 17] = 60.0  # near one-hot
    logits[1, 5] = float("nan")
    logits[2, :] = torch.linspace(-1, 1, 300) + 1e4
    target = torch.tensor([17, 3, 9, -100])
    log_prob, entropy = vt.log_probs_and_entropy(logits, target)
    assert entropy[0] >= 0 and log_prob[0] <= 0
    assert torch.isnan(log_prob[1]) and torch.isnan(entropy[1])
    assert log_prob[3] == 0 and entropy[3] == 0
    want_lp, want_h, _ = reference(logits, target, 1.0, torch.zeros(4), torch.zeros(4))
    assert abs(log_prob[2].item() - want_lp[2].item()) <= 1e-6 * abs(want_lp[2].item())


def test_bad_arguments_are_named():
    logits = torch.randn(4, 50)
    target = torch.randint(0, 50, (4,))
    with pytest.raises(Exception, match="temperature"):
        vt.log_probs_and_entropy(logits, target, temperature=0.0)
    with pytest.raises(Exception, match="temperatures: expected finite values > 0"):
        vt.log_probs_and_entropy(logits, target, temperature=torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(TypeError, match="unexpected options"):
        vt.log_probs_and_entropy(logits, target, label_smoothing=0.1)
    with pytest.raises(ValueError, match="target.shape"):
        vt.log_probs_and_entropy(logits, target[:3])


# Temperatures for targets [2, 4] as users give them: one per token, one per sequence ([2]
# and [2, 1], verl's form), one for all (0-d), and a number.
TEMPERATURE_FORMS = {
    "per_token": lambda: torch.rand(2, 4, generator=torch.Generator().manual_seed(5)) + 0.5,
    "per_sequence": lambda: torch.tensor([0.7, 1.3]),
    "per_sequence_column": lambda: torch.tensor([[0.7], [1.3]]),
    "zero_dimensional": lambda: torch.tensor(0.8),
    "number": lambda: 0.8,
}


@needs_custom_ops
@pytest.mark.parametrize("form", sorted(TEMPERATURE_FORMS))
def test_compiles_without_a_graph_break(form):
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 4, 300, generator=generator, requires_grad=True)
    target = torch.randint(0, 300, (2, 4), generator=generator)
    temperature = TEMPERATURE_FORMS[form]()
    g_lp, g_h = upstream((2, 4), 10), upstream((2, 4), 11)

    def step(x, y, t):
        log_prob, entropy = vt.log_probs_and_entropy(x, y, temperature=t)
        return (log_prob * g_lp + entropy * g_h).sum(), log_prob, entropy

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    objective, log_prob, entropy = compiled(logits, target, temperature)
    objective.backward()
    check(log_prob, entropy, logits.grad, reference(logits, target, temperature, g_lp, g_h))
    got = logits.grad.clone()
    logits.grad = None
    step(logits, target, temperature)[0].backward()
    assert torch.equal(got, logits.grad)


@needs_custom_ops
@pytest.mark.parametrize("form", ["per_sequence", "zero_dimensional"])
def test_head_compiles_without_a_graph_break_with_broadcast_temperatures(form):
    generator = torch.Generator().manual_seed(23)
    hidden = torch.randn(2, 4, 16, generator=generator, requires_grad=True)
    weight = torch.randn(200, 16, generator=generator, requires_grad=True)
    target = torch.randint(0, 200, (2, 4), generator=generator)
    temperature = TEMPERATURE_FORMS[form]()
    g_lp, g_h = upstream((2, 4), 12), upstream((2, 4), 13)

    def step(h, w, y, t):
        log_prob, entropy = vt.linear_log_probs_and_entropy(h, w, y, t)
        return (log_prob * g_lp + entropy * g_h).sum(), log_prob, entropy

    objective, log_prob, entropy = torch.compile(step, fullgraph=True, backend="aot_eager")(
        hidden, weight, target, temperature)
    objective.backward()
    want_lp, want_h, want_dh, want_dw, _ = head_reference(hidden, weight, torch.zeros(200), target, temperature, g_lp,
                                                          g_h)
    assert (log_prob.double() - want_lp).abs().max() <= 1e-5 * max(1.0, want_lp.abs().max().item())
    assert (entropy.double() - want_h).abs().max() <= 1e-5 * max(1.0, want_h.abs().max().item())
    assert (hidden.grad.double() - want_dh).abs().max() <= 1e-4 * want_dh.abs().max()
    assert (weight.grad.double() - want_dw).abs().max() <= 1e-4 * want_dw.abs().max()

    def objective_step(h, w, y, t):
        return vt.linear_policy_objective(h, w, y, g_lp, g_h, t)[0]

    hidden.grad = weight.grad = None
    torch.compile(objective_step, fullgraph=True, backend="aot_eager")(hidden, weight, target, temperature).backward()
    assert (hidden.grad.double() - want_dh).abs().max() <= 1e-4 * want_dh.abs().max()
    assert (weight.grad.double() - want_dw).abs().max() <= 1e-4 * want_dw.abs().max()


def test_an_integer_temperature_tensor_is_refused_in_every_shape():
    logits, target = torch.randn(2, 4, 50), torch.randint(0, 50, (2, 4))
    for temperature in (torch.ones(2, 4, dtype=torch.int64), torch.ones(2, dtype=torch.int64)):
        with pytest.raises(TypeError, match="temperature.dtype: expected a floating-point tensor"):
            vt.log_probs_and_entropy(logits, target, temperature=temperature)


def test_a_temperature_that_requires_grad_is_refused_rather_than_left_without_one():
    logits = torch.randn(2, 4, 50, requires_grad=True)
    target = torch.randint(0, 50, (2, 4))
    hidden, weight = torch.randn(2, 4, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    for temperature in (torch.full((2, 4), 0.7, requires_grad=True), torch.full((2,), 0.7, requires_grad=True)):
        for call in (lambda t: vt.log_probs_and_entropy(logits, target, temperature=t),
                     lambda t: vt.log_probs_and_entropy(logits, target, temperature=t, inplace_backward=True),
                     lambda t: vt.linear_log_probs_and_entropy(hidden, weight, target, t),
                     lambda t: vt.linear_policy_objective(hidden, weight, target, torch.ones(2, 4), None, t)):
            with pytest.raises(ValueError, match="temperature: expected a tensor that does not require grad"):
                call(temperature)


def head_reference(hidden, weight, bias, target, temperature, g_lp, g_h):
    """(log_prob, entropy, grad_hidden, grad_weight, grad_bias) in float64 through the logits."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    b = bias.detach().double().requires_grad_(True)
    logits = h @ w.T + b
    lp, ent, grad = reference(logits.detach(), target, temperature, g_lp, g_h)
    logits.backward(grad)
    return lp, ent, h.grad, w.grad, b.grad


def head_problem(seed, per_token, scalar):
    """hidden [3, 7, 32], weight [403, 32], bias, targets (one ignored), temperatures (per token
    in {0.5, 1, 1.7}, or the scalar), non-uniform upstream gradients of both outputs."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 32, generator=generator, requires_grad=True)
    weight = (torch.randn(403, 32, generator=generator) / 32 ** 0.5 * 3).requires_grad_(True)
    bias = torch.randn(403, generator=generator).requires_grad_(True)
    target = torch.randint(0, 403, (3, 7), generator=generator)
    target[1 + seed % 2, seed % 7] = -100
    temperature = torch.tensor([0.5, 1.0, 1.7])[torch.arange(21) % 3].view(3, 7) if per_token else scalar
    return hidden, weight, bias, target, temperature, upstream((3, 7), seed + 1), upstream((3, 7), seed + 2)


@pytest.mark.parametrize("per_token", [False, True])
def test_head_one_rank_matches_float64(per_token):
    hidden, weight, bias, target, temperature, g_lp, g_h = head_problem(21, per_token, 1.3)
    log_prob, entropy = vt.linear_log_probs_and_entropy(hidden, weight, target, temperature, bias=bias,
                                                        token_block=8, vocab_block=64)
    (log_prob * g_lp + entropy * g_h).sum().backward()
    want_lp, want_h, want_dh, want_dw, want_db = head_reference(hidden, weight, bias, target, temperature, g_lp, g_h)
    assert (log_prob.double() - want_lp).abs().max() <= 1e-6 * want_lp.abs().max()
    assert (entropy.double() - want_h).abs().max() <= 1e-6 * want_h.abs().max()
    for got, want in ((hidden.grad, want_dh), (weight.grad, want_dw), (bias.grad, want_db)):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("per_token", [False, True])
def test_head_policy_objective_matches_float64(per_token):
    """linear_policy_objective (the chunked mode, chunks of 8 of 21 tokens): its objective,
    outputs and gradients against the float64 reference, scaled by a non-unit upstream
    gradient; log_prob and entropy carry no gradient; a second backward is refused."""
    hidden, weight, bias, target, temperature, g_lp, g_h = head_problem(23, per_token, 0.8)
    objective, log_prob, entropy = vt.linear_policy_objective(hidden, weight, target, g_lp, g_h, temperature,
                                                              bias=bias, token_block=4, vocab_block=64,
                                                              chunk_tokens=8)
    assert objective.shape == () and not log_prob.requires_grad and not entropy.requires_grad
    (2.5 * objective).backward()
    want_lp, want_h, want_dh, want_dw, want_db = head_reference(hidden, weight, bias, target, temperature,
                                                                2.5 * g_lp, 2.5 * g_h)
    assert (log_prob.double() - want_lp).abs().max() <= 1e-6 * want_lp.abs().max()
    assert (entropy.double() - want_h).abs().max() <= 1e-6 * want_h.abs().max()
    want_objective = (want_lp * g_lp.double() + want_h * g_h.double()).sum()
    assert abs(objective.item() - want_objective.item()) <= 1e-6 * (want_lp.abs() * g_lp.abs()).sum().item() * 10
    for got, want in ((hidden.grad, want_dh), (weight.grad, want_dw), (bias.grad, want_db)):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(RuntimeError, match="one backward per forward|a second time"):  # (vpce's or autograd's)
        objective.backward()


def test_head_policy_objective_errors_name_the_argument():
    hidden, weight = torch.randn(4, 8), torch.randn(20, 8)
    target = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="log_prob_weights.shape"):
        vt.linear_policy_objective(hidden, weight, target, torch.ones(3))
    with pytest.raises(TypeError, match="entropy_weights"):
        vt.linear_policy_objective(hidden, weight, target, torch.ones(4), entropy_weights=0.1)
    with pytest.raises(TypeError, match="mode"):
        vt.linear_policy_objective(hidden, weight, target, torch.ones(4), mode="chunked")


def test_head_policy_objective_takes_per_sequence_weights_and_refuses_weights_that_want_a_gradient():
    """Weights of one per sequence ([b] for [b, s] tokens, GRPO's advantages) weigh every token
    of their row (the temperature's rule; PyTorch's broadcasting read them per position, and
    refused them where s != b); a weight tensor that requires grad is refused (it got a
    gradient of None, silently)."""
    generator = torch.Generator().manual_seed(31)
    hidden, weight = torch.randn(2, 3, 8, generator=generator), torch.randn(40, 8, generator=generator)
    target = torch.randint(0, 40, (2, 3), generator=generator)
    per_sequence = torch.tensor([0.5, -1.5])
    objective, log_prob, _ = vt.linear_policy_objective(hidden, weight, target, per_sequence)
    want = (log_prob.double() * per_sequence.double().unsqueeze(-1)).sum()
    assert abs(objective.item() - want.item()) <= 1e-6 * log_prob.double().abs().sum().item()
    with pytest.raises(ValueError, match=r"log_prob_weights.shape: expected one per token \(2, 3\), or fewer "
                                         r"dimensions aligned with the target's first ones"):
        vt.linear_policy_objective(hidden, weight, target, torch.ones(3))  # [s]: PyTorch's rule, not vpce's
    for name in ("log_prob_weights", "entropy_weights"):
        wanting = torch.ones(2, 3, requires_grad=True)
        arguments = {"log_prob_weights": torch.ones(2, 3), "entropy_weights": None, name: wanting}
        with pytest.raises(ValueError, match=f"{name}: expected a tensor that does not require grad"):
            vt.linear_policy_objective(hidden, weight, target, **arguments)


def test_a_per_sequence_temperature_follows_the_rows_even_where_the_sequence_is_as_long_as_the_batch():
    """[b] for [b, s] tokens is one per sequence (vpce's rule, the opposite of PyTorch's
    broadcasting), also where s happens to equal b, as [b, 1]; [1, s] is one per position; a
    shape the rule does not take is refused saying the rule (it said "broadcastable to it",
    which PyTorch's broadcasting of (4,) to (3, 4) is)."""
    generator = torch.Generator().manual_seed(33)
    logits = torch.randn(3, 3, 40, generator=generator)
    target = torch.randint(0, 40, (3, 3), generator=generator)
    rows = torch.tensor([[0.5], [1.0], [2.0]])
    for given, t in ((rows.flatten(), rows), (rows, rows), (rows.view(1, 3), rows.view(1, 3))):
        got, _ = vt.log_probs_and_entropy(logits, target, temperature=given)
        want = torch.log_softmax(logits.double() / t.double().unsqueeze(-1), -1).gather(-1, target.unsqueeze(-1))
        assert (got.double() - want.squeeze(-1)).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(ValueError, match=r"temperature.shape: expected one per token \(3, 2\), or fewer dimensions "
                                         r"aligned with the target's first ones .* not PyTorch's broadcasting.*, "
                                         r"got \(4,\)"):
        vt.log_probs_and_entropy(logits[:, :2], target[:, :2], temperature=torch.ones(4))


@needs_custom_ops
def test_float64_temperatures_on_meta_tensors_give_shapes():
    """Meta tensors take the custom ops' fake implementations (as torch.compile's do): a
    float64 temperature there gives the output shapes (the eager check of its values read
    them: Tensor.item() on a meta tensor)."""
    logits = torch.empty(2, 4, 300, device="meta")
    target = torch.empty(2, 4, dtype=torch.int64, device="meta")
    for temperature in (torch.empty(2, dtype=torch.float64, device="meta"),
                        torch.empty(2, 4, dtype=torch.float64, device="meta")):
        log_prob, entropy = vt.log_probs_and_entropy(logits, target, temperature=temperature)
        assert log_prob.shape == entropy.shape == (2, 4) and log_prob.device.type == "meta"


def test_forward_mode_derivatives_are_refused_rather_than_zero():
    """torch.func.jvp and torch.autograd.forward_ad through the loss, the RL outputs and the
    head: NotImplementedError naming the function (the custom ops gave a tangent of zeros,
    where F.cross_entropy's is the directional derivative)."""
    import torch.autograd.forward_ad as forward_ad
    generator = torch.Generator().manual_seed(35)
    x, v = torch.randn(4, 7, generator=generator), torch.randn(4, 7, generator=generator)
    t = torch.randint(0, 7, (4,), generator=generator)
    hidden, weight = torch.randn(4, 3, generator=generator), torch.randn(7, 3, generator=generator)
    calls = {"vocab_parallel_cross_entropy": lambda a: vt.vocab_parallel_cross_entropy(a, t),
             "log_probs_and_entropy": lambda a: vt.log_probs_and_entropy(a, t)[0],
             "linear_cross_entropy": lambda a: vt.linear_cross_entropy(a[:, :3], weight, t),
             "linear_log_probs_and_entropy": lambda a: vt.linear_log_probs_and_entropy(a[:, :3], weight, t)[0],
             "linear_policy_objective": lambda a: vt.linear_policy_objective(a[:, :3], weight, t, torch.ones(4))[0]}
    jvp = getattr(getattr(torch, "func", None), "jvp", None)  # (torch.func: PyTorch >= 2.0)
    for name, call in calls.items():
        if jvp is not None:
            with pytest.raises(NotImplementedError, match=f"{name}: expected operands without a forward-mode tangent"):
                jvp(call, (x,), (v,))
        with forward_ad.dual_level(), pytest.raises(NotImplementedError, match=name):
            call(forward_ad.make_dual(x, v))
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="linear_cross_entropy"):
        vt.linear_cross_entropy(hidden, forward_ad.make_dual(weight, torch.ones_like(weight)), t)
    # Reverse mode through the same call still works.
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(calls["vocab_parallel_cross_entropy"](leaf).sum(), leaf)
    want = torch.softmax(x.double(), -1) - torch.nn.functional.one_hot(t, 7).double()
    assert (grad.double() - want).abs().max() <= 1e-6


def test_rl_arguments_name_their_function_and_hold_in_float32():
    """Unexpected options name the function called (they named another); sum_pi_squared has
    no targets, so ignore_index has nothing to apply to (with 0 every row read as ignored:
    zeros); a bool temperature is refused as label_smoothing's is; a temperature float32 does
    not hold is refused as given (it was named by its rounding: 0 or inf; an int beyond float64
    raised a bare OverflowError)."""
    logits, target = torch.randn(4, 50), torch.randint(0, 50, (4,))
    hidden, weight = torch.randn(4, 8), torch.randn(50, 8)
    want = torch.softmax(logits.double(), -1).pow(2).sum(-1)
    for ignore_index in (0, -100):
        got = vt.sum_pi_squared(logits, ignore_index=ignore_index)
        assert (got.double() - want).abs().max() <= 1e-6 * want.max()
    with pytest.raises(TypeError, match=r"sum_pi_squared: unexpected options \['z_loss_weight'\]"):
        vt.sum_pi_squared(logits, z_loss_weight=0.1)
    with pytest.raises(TypeError, match=r"linear_policy_objective: unexpected options \['reduction'\]"):
        vt.linear_policy_objective(hidden, weight, target, torch.ones(4), reduction="sum")
    with pytest.raises(TypeError, match="temperature: expected a number, got bool True"):
        vt.log_probs_and_entropy(logits, target, temperature=True)
    with pytest.raises(TypeError, match="temperature: expected a number, got bool True"):
        vt.linear_log_probs_and_entropy(hidden, weight, target, temperature=True)
    with pytest.raises(ValueError, match="temperature: expected a number that float32 holds, got 1000000"):
        vt.log_probs_and_entropy(logits, target, temperature=10 ** 400)
    for tiny_or_huge in (1e-50, 1e300):
        with pytest.raises(ValueError, match=f"temperature: expected a value that float32 holds .* got {tiny_or_huge!r}"
                                             .replace("+", r"\+")):
            vt.log_probs_and_entropy(logits, target, temperature=tiny_or_huge)
        per_token = torch.full((4,), tiny_or_huge, dtype=torch.float64)
        with pytest.raises(ValueError, match=f"temperature: expected values that float32 holds .* got {tiny_or_huge!r}"
                                             .replace("+", r"\+")):
            vt.log_probs_and_entropy(logits, target, temperature=per_token)
    # The edges themselves: float32's largest value is taken (and gives finite outputs).
    log_prob, entropy = vt.log_probs_and_entropy(logits, target, temperature=3.4028234663852886e38)
    assert torch.isfinite(log_prob).all() and torch.isfinite(entropy).all()


@needs_custom_ops
def test_head_policy_objective_opcheck():
    generator = torch.Generator().manual_seed(25)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(5, 3, 16, generator=generator).to(dtype).requires_grad_(True)
        weight = torch.randn(40, 16, generator=generator).to(dtype).requires_grad_(True)
        bias = torch.randn(40, generator=generator).to(dtype).requires_grad_(True)
        target = torch.randint(0, 40, (5, 3), generator=generator)
        weights = upstream((5, 3), 26)
        torch.library.opcheck(torch.ops.vpce.rl_linear_chunked.default,
                              (hidden, weight, bias, target, weights, None, None, 0.9, 0, False, "", True, True, True))


@needs_custom_ops
def test_head_policy_objective_compiles_without_a_graph_break():
    generator = torch.Generator().manual_seed(24)
    hidden = torch.randn(6, 16, generator=generator, requires_grad=True)
    weight = torch.randn(200, 16, generator=generator, requires_grad=True)
    target = torch.randint(0, 200, (6,), generator=generator)
    advantages = torch.randn(6, generator=generator)

    def step(h, w, y, a):
        objective, log_prob, entropy = vt.linear_policy_objective(h, w, y, -a / 6, torch.full((6,), -0.01), 0.9)
        return objective, log_prob

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    objective, log_prob = compiled(hidden, weight, target, advantages)
    objective.backward()
    assert not log_prob.requires_grad
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    step(hidden, weight, target, advantages)[0].backward()
    assert torch.equal(got[0], hidden.grad) and torch.equal(got[1], weight.grad)


@needs_custom_ops
def test_head_compiles_without_a_graph_break():
    generator = torch.Generator().manual_seed(22)
    hidden = torch.randn(6, 16, generator=generator, requires_grad=True)
    weight = torch.randn(200, 16, generator=generator, requires_grad=True)
    target = torch.randint(0, 200, (6,), generator=generator)

    def step(h, w, y):
        log_prob, entropy = vt.linear_log_probs_and_entropy(h, w, y, 0.9)
        return (log_prob + 0.1 * entropy).sum()

    torch.compile(step, fullgraph=True, backend="aot_eager")(hidden, weight, target).backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    step(hidden, weight, target).backward()
    assert torch.equal(got[0], hidden.grad) and torch.equal(got[1], weight.grad)


def test_sum_pi_squared_matches_float64():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 7, 300, generator=generator) * 2
    temperature = torch.tensor([0.5, 1.0, 1.7, 1.0, 0.8]).unsqueeze(1).expand(5, 7)
    got = vt.sum_pi_squared(logits, temperature=temperature)
    assert got.shape == (5, 7) and got.dtype == torch.float32 and not got.requires_grad
    p = torch.softmax(logits.double() / temperature.double().unsqueeze(-1), -1)
    want = (p * p).sum(-1)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_nemo_rl_drop_in_matches_float64():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 9, 400, generator=generator, requires_grad=True)
    target = torch.randint(0, 400, (2, 9), generator=generator)
    got = vnemo.from_parallel_logits_to_logprobs(logits, target, 0, 400, None)
    assert got.shape == (2, 8)
    want = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, target[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_nemo_rl_drop_in_leaves_the_temperature_to_its_caller():
    """NeMo-RL's function reads only top_k and top_p of sampling_params (its policy workers
    divide the logits by the temperature before calling it): vpce's takes the logits as given
    too (it divided them again: log_softmax(x / T^2)); top-k or top-p filtering is refused."""
    class SamplingParams:  # the fields of NeMo-RL's TrainingSamplingParams
        def __init__(self, temperature=1.0, top_k=None, top_p=1.0):
            self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    generator = torch.Generator().manual_seed(5)
    scaled = torch.randn(2, 7, 300, generator=generator) / 0.5  # the caller's logits.div_(T)
    target = torch.randint(0, 300, (2, 7), generator=generator)
    got = vnemo.from_parallel_logits_to_logprobs(scaled, target, 0, 300, None,
                                                 sampling_params=SamplingParams(temperature=0.5))
    want = torch.log_softmax(scaled.double(), -1)[:, :-1].gather(-1, target[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    for params in (SamplingParams(top_k=50), SamplingParams(top_p=0.9)):
        with pytest.raises(ValueError, match="sampling_params: expected no top-k or top-p filtering"):
            vnemo.from_parallel_logits_to_logprobs(scaled, target, 0, 300, None, sampling_params=params)
    # The caller's grad mode is kept: under no_grad nothing is recorded (it was turned on).
    leaf = scaled.clone().requires_grad_(True)
    with torch.no_grad():
        assert not vnemo.from_parallel_logits_to_logprobs(leaf, target, 0, 300, None).requires_grad
    assert vnemo.from_parallel_logits_to_logprobs(leaf, target, 0, 300, None).requires_grad


# ---- several ranks ---------------------------------------------------------------------------


def rl_worker(rank, size, init_file):
    group = init_group(rank, size, init_file)
    generator = torch.Generator().manual_seed(11)
    valid = 1009  # a multiple of nothing: padded to the next multiple of the ranks
    vocab = -(-valid // size) * size
    logits = torch.randn(2, 13, vocab, generator=generator) * 3
    target = torch.randint(0, valid, (2, 13), generator=generator)
    target[1, :3] = -100
    temperature = torch.tensor([0.5, 1.0, 1.7])[torch.arange(26) % 3].view(2, 13)
    g_lp, g_h = upstream((2, 13), 5), upstream((2, 13), 6)
    local = vocab // size
    mine = logits[..., rank * local:(rank + 1) * local].clone().requires_grad_(True)
    with CollectiveCounter() as forward_calls:
        log_prob, entropy = vt.log_probs_and_entropy(mine, target, temperature=temperature, tp_group=group,
                                                     valid_vocab_size=valid)
    with CollectiveCounter() as backward_calls:
        (log_prob * g_lp + entropy * g_h).sum().backward()
    assert forward_calls.calls == ["all_gather"], forward_calls.calls
    assert backward_calls.calls == [], backward_calls.calls
    want_lp, want_h, want_grad = reference(logits, target, temperature, g_lp, g_h, valid=valid)
    check(log_prob, entropy, mine.grad, (want_lp, want_h, want_grad[..., rank * local:(rank + 1) * local]))
    # The fused head on the same group: hidden states shared, the weight's rows split.
    generator = torch.Generator().manual_seed(13)
    hidden = torch.randn(2, 13, 24, generator=generator)
    weight = torch.randn(vocab, 24, generator=generator) / 24 ** 0.5 * 3
    h = hidden.clone().requires_grad_(True)
    w = weight[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    with CollectiveCounter() as head_forward:
        head_lp, head_h = vt.linear_log_probs_and_entropy(h, w, target, temperature, tp_group=group,
                                                          valid_vocab_size=valid, token_block=8, vocab_block=64)
    with CollectiveCounter() as head_backward:
        (head_lp * g_lp + head_h * g_h).sum().backward()
    assert head_forward.calls == ["all_gather"], head_forward.calls
    assert head_backward.calls == ["all_reduce"], head_backward.calls  # the hidden gradient's sum
    hd = hidden.double().requires_grad_(True)
    wd = weight.double().requires_grad_(True)
    logits_d = hd @ wd.T
    want_lp, want_h, want_grad = reference(logits_d.detach(), target, temperature, g_lp, g_h, valid=valid)
    logits_d.backward(want_grad)
    assert (head_lp.double() - want_lp).abs().max() <= 1e-6 * want_lp.abs().max()
    assert (head_h.double() - want_h).abs().max() <= 1e-6 * want_h.abs().max()
    assert (h.grad.double() - hd.grad).abs().max() <= 1e-5 * hd.grad.abs().max()
    want_w = wd.grad[rank * local:(rank + 1) * local]
    assert (w.grad.double() - want_w).abs().max() <= 1e-5 * want_w.abs().max()
    outputs = [torch.empty(2, 2, 13) for _ in range(size)]
    dist.all_gather(outputs, torch.stack([log_prob.detach(), entropy.detach()]), group=group)
    assert all(torch.equal(o, outputs[0]) for o in outputs)  # the same bits on every rank
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_match_float64_with_one_gather(size):
    spawn(rl_worker, size)


def sequence_parallel_worker(rank, size, init_file):
    """The head with sequence_parallel=True (each rank its slice of the sequence, dim 0), in the
    recompute and the chunked modes, against the recompute call on the whole sequence: the
    same outputs, hidden's gradient the slice of the whole one (the gather in the forward,
    the reduce-scatter in the backward)."""
    group = init_group(rank, size, init_file)
    generator = torch.Generator().manual_seed(31)
    hidden = torch.randn(6, 3, 16, generator=generator)
    weight = torch.randn(200, 16, generator=generator) / 4 * 3
    target = torch.randint(0, 200, (6, 3), generator=generator)
    temperature = torch.full((6, 3), 0.9)
    g_lp, g_h = upstream((6, 3), 14), upstream((6, 3), 15)
    w_local = weight[rank * 100:(rank + 1) * 100]
    results = []
    for sequence_parallel in (False, True):
        h = (hidden[rank * 3:(rank + 1) * 3] if sequence_parallel else hidden).clone().requires_grad_(True)
        w = w_local.clone().requires_grad_(True)
        lp, ent = vt.linear_log_probs_and_entropy(h, w, target, temperature, tp_group=group,
                                                  sequence_parallel=sequence_parallel)
        (lp * g_lp + ent * g_h).sum().backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    # The chunked mode (linear_policy_objective) with sequence parallelism, chunks of 8 of 18.
    h = hidden[rank * 3:(rank + 1) * 3].clone().requires_grad_(True)
    w = w_local.clone().requires_grad_(True)
    objective, lp, ent = vt.linear_policy_objective(h, w, target, g_lp, g_h, temperature, tp_group=group,
                                                    sequence_parallel=True, token_block=4, chunk_tokens=8)
    objective.backward()
    results.append((lp, ent, h.grad, w.grad))
    (lp_a, ent_a, dh_a, dw_a), *others = results
    for lp_b, ent_b, dh_b, dw_b in others:
        assert torch.allclose(lp_a, lp_b, rtol=0, atol=1e-6) and torch.allclose(ent_a, ent_b, rtol=0, atol=1e-6)
        assert torch.allclose(dh_b, dh_a[rank * 3:(rank + 1) * 3], rtol=0, atol=1e-6)
        assert torch.allclose(dw_a, dw_b, rtol=0, atol=1e-6)
    dist.destroy_process_group()


def test_head_with_sequence_parallelism():
    spawn(sequence_parallel_worker, 2)


def failing_rank_worker(rank, size, init_file):
    """One rank's bad argument to the RL functions (a weight of another shape, an unknown
    option): every rank raises, naming it, and the group stays usable."""
    group = init_group(rank, size, init_file)
    generator = torch.Generator().manual_seed(41)
    hidden = torch.randn(6, 16, generator=generator)
    weight = torch.randn(100, 16, generator=generator)
    target = torch.randint(0, 200, (6,), generator=generator)
    weights = torch.ones(5 if rank == 1 else 6)
    with pytest.raises(Exception, match="log_prob_weights.shape"):
        vt.linear_policy_objective(hidden, weight, target, weights, tp_group=group)
    options = {"not_an_option": 1} if rank == 1 else {}
    logits = hidden @ weight.T
    for call in (lambda: vt.linear_policy_objective(hidden, weight, target, torch.ones(6), tp_group=group, **options),
                 lambda: vt.linear_log_probs_and_entropy(hidden, weight, target, tp_group=group, **options),
                 lambda: vt.log_probs_and_entropy(logits, target, tp_group=group, **options)):
        with pytest.raises(Exception, match="not_an_option"):
            call()
    log_prob, _ = vt.linear_log_probs_and_entropy(hidden, weight, target, tp_group=group)  # the group still works
    assert torch.isfinite(log_prob).all()
    dist.destroy_process_group()


def one_rank_refused_worker(rank, size, init_file):
    """A float64 temperature float32 cannot hold, or a forward-mode tangent, on rank 1 only:
    no rank is left waiting in the collective. The temperature fails every rank alike; the
    tangent's rank runs the collective on the primal values and then raises, the other rank
    gets its outputs."""
    import torch.autograd.forward_ad as forward_ad  # noqa: PLC0415
    group = init_group(rank, size, init_file)
    logits = torch.randn(2, 4, 50, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(4))
    temperature = torch.full((2,), 1e-50 if rank == 1 else 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="rank 1 of 2: temperature: expected values that float32 holds"):
        vt.log_probs_and_entropy(logits, target, temperature=temperature, tp_group=group)
    with forward_ad.dual_level():
        x = forward_ad.make_dual(logits, torch.ones_like(logits)) if rank == 1 else logits
        if rank == 1:
            with pytest.raises(NotImplementedError, match="vocab_parallel_cross_entropy: expected operands without"):
                vt.vocab_parallel_cross_entropy(x, target, tp_group=group)
        else:
            assert vt.vocab_parallel_cross_entropy(x, target, tp_group=group).shape == (2, 4)
    dist.barrier(group=group)  # the group is still in step
    dist.destroy_process_group()


def test_a_rank_refused_for_its_temperature_or_tangent_leaves_no_rank_waiting():
    spawn(one_rank_refused_worker, 2)


def test_a_rank_with_a_bad_argument_does_not_leave_the_others_waiting():
    spawn(failing_rank_worker, 2)


def load_verl():
    """verl 0.9.1's tensor_parallel module, loaded by its path (its package imports ray)."""
    spec = importlib.util.find_spec("verl")
    path = os.path.join(spec.submodule_search_locations[0], "utils", "megatron", "tensor_parallel.py")
    module_spec = importlib.util.spec_from_file_location("verl_tensor_parallel", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def verl_worker(rank, size, init_file):
    from test_megatron_core import megatron_init  # noqa: PLC0415

    megatron_init(rank, size, init_file)
    verl = load_verl()
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(64, 2000, generator=generator) * 2
    target = torch.randint(0, 2000, (64,), generator=generator)
    local = 2000 // size
    mine = logits[:, rank * local:(rank + 1) * local]
    g = upstream((64,), 7)
    results = []
    squares = [module.vocab_parallel_sum_pi_squared(mine.clone()) for module in (verl, vverl)]
    assert (squares[0] - squares[1]).abs().max() <= 1e-5 * squares[0].abs().max()
    for module, name in ((verl, "verl"), (vverl, "vpce")):
        x = mine.clone().requires_grad_(True)
        log_prob = module.vocab_parallel_log_probs_from_logits(x, target)
        x2 = mine.clone().requires_grad_(True)
        entropy = module.vocab_parallel_entropy(x2)
        (log_prob * g).sum().backward()
        (entropy * g).sum().backward()
        results.append((name, log_prob.detach(), entropy.detach(), x.grad, x2.grad))
    (_, lp_a, h_a, g1_a, g2_a), (_, lp_b, h_b, g1_b, g2_b) = results
    assert (lp_a - lp_b).abs().max() <= 2e-6 * lp_a.abs().max()
    assert (h_a - h_b).abs().max() <= 1e-5 * h_a.abs().max()
    assert (g1_a - g1_b).abs().max() <= 1e-5 * g1_a.abs().max()
    assert (g2_a - g2_b).abs().max() <= 1e-4 * g2_a.abs().max()
    dist.destroy_process_group()


@pytest.mark.skipif(importlib.util.find_spec("verl") is None or importlib.util.find_spec("megatron") is None,
                    reason="verl 0.9.1 and megatron-core are installed in the PyPI torch environment only")
def test_verl_drop_ins_match_verl():
    spawn(verl_worker, 2)
