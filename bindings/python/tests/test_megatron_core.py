"""vpce.torch side by side with the real megatron-core (from PyPI) on the same inputs, under
gloo groups of 1, 2 and 4 processes with Megatron's parallel_state initialised
(initialize_model_parallel(tensor_model_parallel_size=R)):

- the plain loss and gradient of vocab_parallel_cross_entropy within 1e-6 relative (fp32),
  and of Megatron's fused branch (fused_vocab_parallel_cross_entropy; Megatron rounds that
  gradient to bf16, so within bf16 rounding);
- each static helper megatron-core has, on the same inputs: bit for bit, or within 1 ulp
  where vpce's exponential differs from torch's, with the same in-place effects; the row
  sums of those exponentials within 2 ulps of Megatron's and as close to exact (+ 1 ulp);
- label smoothing: vpce's default against the float64 reference, and
  megatron_legacy_label_smoothing=True against megatron-core's own values;
- LanguageModule.compute_language_model_loss with vpce swapped in, unfused and fused
  (cross_entropy_fusion_impl='native'), against Megatron's own result;
- the wholesale swap, sys.modules["megatron.core.tensor_parallel.cross_entropy"] =
  vpce.torch before Megatron is imported, with Megatron's fused path (its JIT on) composing
  vpce's helpers.

Megatron-core needs PyTorch >= 2.6: on Debian's 1.13 these tests skip. In the spawned
ranks Megatron's JIT fuser (torch.compile of its fused helpers) is disabled, which changes
nothing in what they compute and saves an inductor compilation per process; the wholesale
swap test keeps it on."""
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core (needs PyTorch >= 2.6) is not installed")

import torch.distributed as dist  # noqa: E402

import vpce.torch as vt  # noqa: E402
from reference import loss_and_grad, megatron_legacy, relative_error  # noqa: E402
from test_distributed import GROUP_TIMEOUT, global_problem, spawn  # noqa: E402


def megatron_init(rank, size, init_file):
    import megatron.core.jit as jit  # noqa: PLC0415

    jit.disable_jit_fuser()  # before the fusions are imported (their decorator reads it)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)
    torch.set_num_threads(1)
    from megatron.core import parallel_state  # noqa: PLC0415

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=size, distributed_timeout_minutes=1)
    return parallel_state.get_tensor_model_parallel_group()


def shard(logits, rank, size):
    local = logits.shape[-1] // size
    return rank * local, (rank + 1) * local


def ulps(actual, expected):
    """Largest |actual - expected| in float32 ulps at expected."""
    expected = expected.double()
    spacing = torch.pow(2.0, torch.floor(torch.log2(expected.abs().clamp_min(2.0**-126))) - 23)
    return ((actual.double() - expected).abs() / spacing).max().item()


def check_plain_loss_and_gradient(group, rank, size):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy  # noqa: PLC0415
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: PLC0415

    logits, target, grad_loss = global_problem(seed=31, shape=(6, 3), vocab=4 * 50)
    begin, end = shard(logits, rank, size)
    x_megatron = logits[..., begin:end].clone().requires_grad_()
    loss_megatron = vocab_parallel_cross_entropy(x_megatron * 1, target)  # Megatron overwrites fp32 inputs
    loss_megatron.backward(grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss)
    for call in (lambda x: vt.vocab_parallel_cross_entropy(x, target),  # tp_group=None: Megatron's group
                 lambda x: vt.vocab_parallel_cross_entropy(x, target, 0.0, group),
                 lambda x: vt._VocabParallelCrossEntropy.apply(x, target, 0.0, group),
                 lambda x: vt.unfused_cross_entropy(x, target, tp_group=group)):
        x = logits[..., begin:end].clone().requires_grad_()
        loss = call(x)
        loss.backward(grad_loss)
        assert relative_error(loss.detach(), loss_megatron.detach()) < 1e-6
        assert relative_error(x.grad, x_megatron.grad) < 1e-6
        assert relative_error(loss.detach(), want_loss) < 1e-6
        assert relative_error(x.grad, want_grad[..., begin:end]) < 1e-6
    # The fused branch: Megatron returns its gradient rounded to bf16; vpce's is fp32.
    x_fused = logits[..., begin:end].clone().requires_grad_()
    loss_fused = fused_vocab_parallel_cross_entropy(x_fused * 1, target, group)
    loss_fused.backward(grad_loss)
    x = logits[..., begin:end].clone().requires_grad_()
    loss = vt.fused_vocab_parallel_cross_entropy(x, target, group)
    loss.backward(grad_loss)
    assert relative_error(loss.detach(), loss_fused.detach()) < 1e-6
    assert ((x.grad.double() - x_fused.grad.double()).abs() <= x.grad.double().abs() * 2.0**-8 + 1e-30).all()


def check_helpers(group, rank, size):
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as M  # noqa: PLC0415

    V = vt.VocabParallelCrossEntropy
    logits, target, grad_loss = global_problem(seed=37, shape=(8, 3), vocab=4 * 300)
    begin, end = shard(logits, rank, size)
    local = logits[..., begin:end].contiguous()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xm, xv = local.to(dtype), local.to(dtype)
        wm, mm = M.calculate_logits_max(xm)
        wv, mv = V.calculate_logits_max(xv)
        assert (wm is xm) == (wv is xv), dtype  # the same tensor back for float32, a new one otherwise
        assert wv.dtype == wm.dtype and torch.equal(wv, wm) and torch.equal(mv, mm), dtype
    # calculate_predicted_logits, on the all-reduced max as Megatron's forward has it.
    xm, logits_max = M.calculate_logits_max(local.clone())
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    xv = xm.clone()
    out_m = M.calculate_predicted_logits(xm, target, logits_max, begin, end)
    out_v = V.calculate_predicted_logits(xv, target, logits_max, begin, end)
    assert out_m[4] is xm and out_v[4] is xv  # the logits, overwritten with exp in place
    for a, b in zip(out_m[:3], out_v[:3]):  # mask, local ids, predicted logits
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert out_v[3].dtype == out_m[3].dtype == torch.float32 and out_v[3].shape == out_m[3].shape
    assert ulps(out_v[4], out_m[4]) <= 1.0  # vpce's exp and torch's: within 1 ulp of each other
    # The row sums: torch's summation of exponentials that differ by up to 1 ulp from torch's,
    # so within 2 ulps of Megatron's, and as close to the exact sum as Megatron's (+ 1 ulp).
    exact = torch.exp(local.double() - logits_max.double().unsqueeze(-1)).sum(-1)
    assert ulps(out_v[3], out_m[3]) <= 2.0
    assert ulps(out_v[3], exact) <= ulps(out_m[3], exact) + 1.0
    # A max of another dtype than the logits' (bf16 logits and their float32 max; float32
    # logits and a float64 max): the predicted logits in the logits' dtype and value, as
    # Megatron's shift in place leaves them (they came promoted: float32, float64).
    for x_dtype, max_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float64)):
        x = local.to(x_dtype)
        other_max = x.to(max_dtype).max(dim=-1)[0]
        pm = M.calculate_predicted_logits(x.clone(), target, other_max, begin, end)[2]
        pv = V.calculate_predicted_logits(x.clone(), target, other_max, begin, end)[2]
        assert pv.dtype == pm.dtype == x_dtype and torch.equal(pv, pm), (x_dtype, max_dtype)
    # The rest take the same inputs in both: bit for bit, the same in-place effects.
    dist.all_reduce(out_m[2], group=group)
    dist.all_reduce(out_m[3], group=group)
    exp_m, exp_v = out_m[4].clone(), out_m[4].clone()
    sm, lm = M.calculate_cross_entropy_loss(exp_m, out_m[2], out_m[3])
    sv, lv = V.calculate_cross_entropy_loss(exp_v, out_m[2], out_m[3])
    assert sm is exp_m and sv is exp_v and torch.equal(sm, sv) and torch.equal(lm, lv)
    prep_m = M.prepare_gradient_calculation_operands(sm, out_m[0])
    prep_v = V.prepare_gradient_calculation_operands(sv, out_m[0])
    assert prep_m[3] is sm and prep_v[3] is sv
    assert prep_v[0].data_ptr() == sv.data_ptr() and prep_m[0].data_ptr() == sm.data_ptr()
    for a, b in zip(prep_m, prep_v):
        assert a.dtype == b.dtype and torch.equal(a, b)
    gm = M.calculate_gradients(prep_m[0], prep_m[1], out_m[1], prep_m[2], prep_m[3], grad_loss)
    gv = V.calculate_gradients(prep_v[0], prep_v[1], out_m[1], prep_v[2], prep_v[3], grad_loss)
    assert gm is sm and gv is sv and torch.equal(gm, gv)
    want_loss, _ = loss_and_grad(logits, target, grad_loss)
    assert relative_error(lv, want_loss) < 1e-6


def check_label_smoothing(group, rank, size):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: PLC0415

    logits, target, grad_loss = global_problem(seed=41, shape=(5, 3), vocab=4 * 60)
    begin, end = shard(logits, rank, size)
    xm = logits[..., begin:end].clone().requires_grad_()
    loss_megatron = vocab_parallel_cross_entropy(xm * 1, target, 0.1)
    loss_megatron.backward(grad_loss)
    xl = logits[..., begin:end].clone().requires_grad_()
    legacy = vt.vocab_parallel_cross_entropy(xl, target, 0.1, megatron_legacy_label_smoothing=True)
    legacy.backward(grad_loss)
    assert relative_error(legacy.detach(), loss_megatron.detach()) < 1e-6
    assert relative_error(xl.grad, xm.grad) < 1e-6
    want_legacy, _ = megatron_legacy(logits, target, begin, end, grad_loss, 0.1)  # the formula, in float64
    assert relative_error(loss_megatron.detach(), want_legacy) < 1e-5
    x = logits[..., begin:end].clone().requires_grad_()
    exact = vt.vocab_parallel_cross_entropy(x, target, 0.1)
    exact.backward(grad_loss)
    want_loss, want_grad = loss_and_grad(logits, target, grad_loss, label_smoothing=0.1)
    assert relative_error(exact.detach(), want_loss) < 1e-6
    assert relative_error(x.grad, want_grad[..., begin:end]) < 1e-6
    if size > 1:  # Megatron's own differs from the exact loss there (the shard's size and mean)
        assert relative_error(loss_megatron.detach(), want_loss) > 1e-4


def check_language_module(group, rank, size):
    from megatron.core import tensor_parallel  # noqa: PLC0415
    from megatron.core.models.common.language_module import language_module  # noqa: PLC0415

    logits, target, grad_loss = global_problem(seed=43, shape=(6, 2), vocab=4 * 40)  # [s, b, V]
    begin, end = shard(logits, rank, size)
    labels = target.transpose(0, 1).contiguous()  # [b, s], as the model hands them over
    for fusion in (False, True):
        module = SimpleNamespace(
            config=SimpleNamespace(cross_entropy_loss_fusion=fusion, cross_entropy_fusion_impl="native"),
            pg_collection=SimpleNamespace(tp=group), tp_group=group)
        xm = logits[..., begin:end].clone().requires_grad_()
        want = language_module.LanguageModule.compute_language_model_loss(module, labels=labels, logits=xm * 1)
        want.backward(grad_loss.t())
        saved = (tensor_parallel.vocab_parallel_cross_entropy, language_module.fused_vocab_parallel_cross_entropy)
        tensor_parallel.vocab_parallel_cross_entropy = vt.vocab_parallel_cross_entropy
        language_module.fused_vocab_parallel_cross_entropy = vt.fused_vocab_parallel_cross_entropy
        try:
            x = logits[..., begin:end].clone().requires_grad_()
            loss = language_module.LanguageModule.compute_language_model_loss(module, labels=labels, logits=x)
        finally:
            tensor_parallel.vocab_parallel_cross_entropy, language_module.fused_vocab_parallel_cross_entropy = saved
        loss.backward(grad_loss.t())
        assert loss.shape == labels.shape
        assert relative_error(loss.detach(), want.detach()) < 1e-6, fusion
        tolerance = 2.0**-8 if fusion else 1e-6  # Megatron's fused gradient is rounded to bf16
        assert relative_error(x.grad, xm.grad) < tolerance, fusion


def worker(rank, size, init_file):
    group = megatron_init(rank, size, init_file)
    for check in (check_plain_loss_and_gradient, check_helpers, check_label_smoothing, check_language_module):
        check(group, rank, size)
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_against_megatron_core(size):
    spawn(worker, size)


WHOLESALE = textwrap.dedent("""
    import sys, torch, vpce.torch
    sys.modules["megatron.core.tensor_parallel.cross_entropy"] = vpce.torch
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import cross_entropy
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.models.common.language_module import language_module
    assert cross_entropy is vpce.torch
    assert tensor_parallel.vocab_parallel_cross_entropy is vpce.torch.vocab_parallel_cross_entropy
    assert fused_cross_entropy.VocabParallelCrossEntropy is vpce.torch.VocabParallelCrossEntropy

    import tempfile, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 2, 80, generator=generator) * 3
    target = torch.randint(0, 80, (6, 2), generator=generator)
    want = torch.nn.functional.cross_entropy(logits.double().reshape(-1, 80), target.reshape(-1), reduction="none")
    # Megatron's own fused path (its JIT on: torch.compile), composing vpce's helpers.
    x = logits.clone().requires_grad_()
    loss = fused_cross_entropy.fused_vocab_parallel_cross_entropy(x * 1, target, dist.group.WORLD)
    loss.sum().backward()
    error = ((loss.double().reshape(-1) - want).abs().max() / want.abs().max()).item()
    assert error < 1e-6, error
    probabilities = torch.softmax(logits.double(), -1)
    probabilities.view(-1, 80)[torch.arange(12), target.reshape(-1)] -= 1
    assert ((x.grad.double() - probabilities).abs() <= probabilities.abs() * 2.0**-8 + 1e-30).all()
    print("wholesale swap ok")
""")


def test_wholesale_module_swap_before_megatron_is_imported():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", WHOLESALE], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wholesale swap ok" in result.stdout
