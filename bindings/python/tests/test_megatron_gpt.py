"""vpce.megatron.fuse_output_layer on the real megatron-core GPTModel (from PyPI), trained:
a tiny GPTModel (2 layers, tensor parallelism 2 on gloo, on the CPU) trained a few steps of
Adam with Megatron's own output layer and loss, then from the same initial weights with the
integration (recompute and chunked modes), tied and untied embeddings, a bias on the output
layer, a loss mask with zeros, a padded vocabulary, gradient-accumulation fusion into
main_grad: step 1's loss within one fp32 ulp of Megatron's and every parameter's gradient
within fp32 rounding, every rank's loss identical, the training curves together. A forward
without labels still returns Megatron's logits. Label smoothing both ways (Megatron's legacy
one against Megatron's own function, vpce's exact one against vpce's loss on Megatron's
logits) and a bf16 model (Float16Module; the logits rounded as Megatron's bf16 layer does)
one step each, a model with a multi-token prediction layer, and the RL outputs
(log-probabilities and entropy) through the fused head against those of Megatron's logits.

The CPU patches GPTModel needs, and only those (docs/python.md lists them): Megatron's CUDA
RNG tracker replaced by one whose fork() does nothing (dropout is 0 here), and
torch.cuda.current_device answering "cpu". Sequence parallelism needs reduce-scatter, which
gloo lacks, so it is not trained here (vpce.torch's head is tested with it in
test_linear_cross_entropy.py)."""
import contextlib

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core (needs PyTorch >= 2.6) is not installed")

import torch.distributed as dist  # noqa: E402

import vpce.torch as vt  # noqa: E402
from reference import relative_error  # noqa: E402
from test_distributed import spawn  # noqa: E402

VOCAB, HIDDEN, SEQUENCE, BATCH, STEPS = 96, 32, 16, 2, 4
USED = 90  # a padded vocabulary: the tokenizer's 90 classes, padded to 96 (48 a rank)


def cpu_patches():
    """The two patches GPTModel needs on a CPU (the docs' recipe)."""
    import megatron.core.tensor_parallel.random as random  # noqa: PLC0415

    class Tracker:  # Megatron's CUDA RNG tracker: forks only around dropout
        def fork(self, name=None):
            return contextlib.nullcontext()

        def add(self, name, seed):
            pass

    import megatron.core.tensor_parallel as tensor_parallel  # noqa: PLC0415

    tracker = Tracker()
    random.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    torch.cuda.current_device = lambda: "cpu"


def build(size, tied, bias, fusion, bf16=False):
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    torch.manual_seed(0)  # the same weights on every rank before each layer takes its part
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=size, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0, add_bias_linear=bias,
                               gradient_accumulation_fusion=False, bf16=bf16,
                               pipeline_dtype=torch.bfloat16 if bf16 else None)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQUENCE, share_embeddings_and_output_weights=tied)
    if bf16:  # as Megatron's training wraps a bf16 model
        from megatron.core.transformer.module import Float16Module  # noqa: PLC0415

        model = Float16Module(config, model)
    if fusion:  # Megatron's DDP buffers, as gradient-accumulation fusion adds into them
        model.output_layer.gradient_accumulation_fusion = True
    return model


def batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    labels = torch.randint(0, USED, (BATCH, SEQUENCE), generator=generator)
    loss_mask = (torch.rand(BATCH, SEQUENCE, generator=generator) > 0.25).float()
    position_ids = torch.arange(SEQUENCE).unsqueeze(0).expand(BATCH, SEQUENCE)
    attention_mask = torch.ones(BATCH, 1, SEQUENCE, SEQUENCE, dtype=torch.bool).tril().logical_not()
    return tokens, position_ids, attention_mask, labels, loss_mask


def train(size, tied, bias, fused, mode="recompute", fusion=False):
    """(losses of each step, step 1's gradients, the no-label logits of step 1)."""
    import vpce.megatron  # noqa: PLC0415

    model = build(size, tied, bias, fusion)
    if fusion:
        for parameter in model.parameters():
            parameter.main_grad = torch.zeros_like(parameter)
    if fused:
        vpce.megatron.fuse_output_layer(model, mode=mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, first_gradients = [], None
    calls = []  # vpce's head, counted: a fused model must take it at every step, never the logits
    head = vt.linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(kwargs.get("mode"))
        return head(*args, **kwargs)

    vt.linear_cross_entropy = counted
    for step in range(STEPS):
        tokens, position_ids, attention_mask, labels, loss_mask = batch(step)
        optimizer.zero_grad()
        if fusion:
            for parameter in model.parameters():
                parameter.main_grad.zero_()
        per_token = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        assert per_token.shape == (BATCH, SEQUENCE)
        loss = (per_token * loss_mask).sum() / loss_mask.sum()  # Megatron's loss function
        loss.backward()
        if fusion:  # what Megatron's optimizer does: main_grad is the gradient
            for parameter in model.parameters():
                if parameter.grad is None:
                    parameter.grad = parameter.main_grad.clone()
                else:
                    parameter.grad += parameter.main_grad
        if step == 0:
            first_gradients = {name: parameter.grad.detach().clone() for name, parameter in model.named_parameters()}
        losses.append(loss.detach())
        optimizer.step()
    with torch.no_grad():
        tokens, position_ids, attention_mask, _, _ = batch(0)
        logits = model(tokens, position_ids, attention_mask)  # no labels: Megatron's logits
    vt.linear_cross_entropy = head
    assert calls == ([mode] * STEPS if fused else []), calls
    return losses, first_gradients, logits


def worker(rank, size, init_file):
    from test_megatron_core import megatron_init  # noqa: PLC0415

    group = megatron_init(rank, size, init_file)
    cpu_patches()
    for tied, bias, fusion in ((True, False, False), (False, True, False), (True, False, True)):
        # (Megatron's own gradient-accumulation fusion is a CUDA kernel: its run here is without.)
        want_losses, want_gradients, want_logits = train(size, tied, bias, fused=False)
        for mode in ("recompute", "chunked"):
            losses, grads, logits = train(size, tied, bias, fused=True, mode=mode, fusion=fusion)
            case = f"tied={tied} bias={bias} fusion={fusion} mode={mode}"
            # Step 1 from the same weights: the loss within one fp32 ulp, every gradient within
            # fp32 rounding.
            ulp = torch.finfo(torch.float32).eps * want_losses[0].abs()
            assert (losses[0] - want_losses[0]).abs() <= ulp, (case, losses[0], want_losses[0])
            for name, want in want_gradients.items():
                assert relative_error(grads[name], want) < 2e-5, (case, name, relative_error(grads[name], want))
            # The curves stay together; without labels the model still gives the logits.
            for step in range(STEPS):
                assert relative_error(losses[step], want_losses[step]) < 1e-4, (case, step)
            assert logits.shape == want_logits.shape and relative_error(logits, want_logits) < 1e-3, case
            # Every rank has the same loss, bit for bit.
            gathered = [torch.zeros_like(losses[0]) for _ in range(size)]
            dist.all_gather(gathered, losses[0], group=group)
            assert all(torch.equal(g, gathered[0]) for g in gathered), (case, gathered)
    dist.destroy_process_group()


def smoothed_step(size, loss_kind):
    """One forward and backward of the untied, biased model with label smoothing 0.1, the loss
    by `loss_kind`: "megatron" (Megatron's own vocab_parallel_cross_entropy, whose smoothing
    is over each rank's shard), "vpce-legacy" (the integration with
    megatron_legacy_label_smoothing), "vpce" (the integration, vpce's exact smoothing) or
    "vpce-swap" (Megatron's output layer, then vpce's vocab_parallel_cross_entropy on its
    logits). (this rank's per-token losses [b, s], the gradients)."""
    import megatron.core.tensor_parallel as tensor_parallel  # noqa: PLC0415

    import vpce.megatron  # noqa: PLC0415

    model = build(size, tied=False, bias=True, fusion=False)
    if loss_kind in ("megatron", "vpce-swap"):
        function = (tensor_parallel.vocab_parallel_cross_entropy if loss_kind == "megatron"
                    else vt.vocab_parallel_cross_entropy)

        def compute_language_model_loss(labels, logits):  # GPTModel's, with the smoothing
            return function(logits, labels.transpose(0, 1).contiguous(), 0.1).transpose(0, 1).contiguous()

        model.compute_language_model_loss = compute_language_model_loss
    else:
        vpce.megatron.fuse_output_layer(model, label_smoothing=0.1,
                                        megatron_legacy_label_smoothing=loss_kind == "vpce-legacy")
    tokens, position_ids, attention_mask, labels, loss_mask = batch(0)
    per_token = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    ((per_token * loss_mask).sum() / loss_mask.sum()).backward()
    return per_token.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def bf16_step(size, loss_kind):
    """One forward and backward of a bf16 model (Float16Module), tied embeddings, a bias: the
    loss by Megatron ("megatron"), by the integration with fp32 logits ("vpce") or rounding
    them as Megatron's bf16 layer does ("vpce-rounded"). (per-token losses, gradients)."""
    import vpce.megatron  # noqa: PLC0415

    model = build(size, tied=True, bias=True, fusion=False, bf16=True)
    if loss_kind == "vpce-rounded":
        vpce.megatron.fuse_output_layer(model, round_logits=True, bf16_logit_gradients=True)
    elif loss_kind == "vpce":
        vpce.megatron.fuse_output_layer(model)
    tokens, position_ids, attention_mask, labels, loss_mask = batch(0)
    per_token = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    ((per_token * loss_mask).sum() / loss_mask.sum()).backward()
    return per_token.detach(), {name: parameter.grad.float() for name, parameter in model.named_parameters()}


def bf16_worker(rank, size, init_file):
    from test_megatron_core import megatron_init  # noqa: PLC0415

    megatron_init(rank, size, init_file)
    cpu_patches()
    want, want_gradients = bf16_step(size, "megatron")
    rounded, rounded_gradients = bf16_step(size, "vpce-rounded")
    exact, _ = bf16_step(size, "vpce")
    # Rounding the logits as Megatron's bf16 layer does: each token's loss within a few fp32
    # ulps of Megatron's (the GEMMs sum in another order, which moves a rare logit across a
    # bf16 rounding boundary), the step's loss within one; each gradient within a few bf16
    # ulps in norm (the model's bf16 backward carries those differences on: 1.5 % at most).
    loss_mask = batch(0)[4]
    step_loss = lambda per_token: (per_token * loss_mask).sum() / loss_mask.sum()  # noqa: E731
    ulp = torch.finfo(torch.float32).eps * step_loss(want).abs()
    assert (step_loss(rounded) - step_loss(want)).abs() <= ulp, (step_loss(rounded), step_loss(want))
    assert (rounded - want).abs().max() < 2e-6, (rounded - want).abs().max()
    for name, expected in want_gradients.items():
        distance = (rounded_gradients[name] - expected).norm() / expected.norm()
        assert distance < 2e-2, (name, distance)  # bf16's ulp is 2^-8 to 2^-7 of a value
    # The default, fp32 logits: another loss, by bf16's rounding of the logits.
    assert (exact - want).abs().max() > 1e-4, (exact - want).abs().max()
    dist.destroy_process_group()


def test_bf16_through_the_fused_head():
    spawn(bf16_worker, 2)


def mtp_step(size, fused):
    """One forward and backward of a model with a multi-token prediction layer (its loss
    scaled by 0.3 into the main loss): (the step's loss, the gradients, the head's calls)."""
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,  # noqa: PLC0415
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    import vpce.megatron  # noqa: PLC0415

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=size, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    spec = get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQUENCE,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    if fused:
        vpce.megatron.fuse_output_layer(model)
    calls = []
    head = vt.linear_cross_entropy
    vt.linear_cross_entropy = lambda *args, **kwargs: calls.append(1) or head(*args, **kwargs)
    tokens, position_ids, attention_mask, labels, loss_mask = batch(0)
    per_token = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    loss = (per_token * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    vt.linear_cross_entropy = head
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, len(calls)


def mtp_worker(rank, size, init_file):
    from test_megatron_core import megatron_init  # noqa: PLC0415

    megatron_init(rank, size, init_file)
    cpu_patches()
    want, want_gradients, _ = mtp_step(size, fused=False)
    got, gradients, calls = mtp_step(size, fused=True)
    assert calls == 2, calls  # the main head and the MTP layer's, both through vpce's head
    assert (got - want).abs() <= torch.finfo(torch.float32).eps * want.abs(), (got, want)
    for name, expected in want_gradients.items():
        assert relative_error(gradients[name], expected) < 2e-5, (name, relative_error(gradients[name], expected))
    dist.destroy_process_group()


def smoothing_worker(rank, size, init_file):
    from test_megatron_core import megatron_init  # noqa: PLC0415

    group = megatron_init(rank, size, init_file)
    cpu_patches()
    # Megatron's legacy smoothing through the head: Megatron's own per-rank losses (they differ
    # by rank) and gradients, within fp32 rounding.
    want, want_gradients = smoothed_step(size, "megatron")
    got, gradients = smoothed_step(size, "vpce-legacy")
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    for name, expected in want_gradients.items():
        assert relative_error(gradients[name], expected) < 2e-5, (name, relative_error(gradients[name], expected))
    gathered = [torch.zeros_like(got) for _ in range(size)]
    dist.all_gather(gathered, got, group=group)
    assert not torch.equal(gathered[0], gathered[1])  # each rank its own smoothing, as Megatron's
    # vpce's exact smoothing through the head: as vpce's loss on Megatron's logits, the same on
    # every rank.
    want, want_gradients = smoothed_step(size, "vpce-swap")
    got, gradients = smoothed_step(size, "vpce")
    assert relative_error(got, want) < 1e-6, relative_error(got, want)
    for name, expected in want_gradients.items():
        assert relative_error(gradients[name], expected) < 2e-5, (name, relative_error(gradients[name], expected))
    dist.all_gather(gathered, got, group=group)
    assert torch.equal(gathered[0], gathered[1])
    dist.destroy_process_group()


def refusal_worker(rank, size, init_file):
    from test_megatron_core import megatron_init  # noqa: PLC0415

    import vpce.megatron  # noqa: PLC0415

    megatron_init(rank, size, init_file)
    cpu_patches()
    model = build(size, tied=False, bias=False, fusion=False)
    with pytest.raises(ValueError, match="mode: expected one of"):
        vpce.megatron.fuse_output_layer(model, mode="fast")
    with pytest.raises(ValueError, match="reduction: set by the mode"):
        vpce.megatron.fuse_output_layer(model, reduction="sum")
    # Options the layer sets, or misspelt, are refused when fusing (they failed at the first
    # forward: "dict() got multiple values", or a list of names without the one meant).
    with pytest.raises(ValueError, match=r"options \['sequence_parallel'\]: set from the output layer"):
        vpce.megatron.fuse_output_layer(model, sequence_parallel=False)
    with pytest.raises(TypeError, match=r"unexpected options \['label_smothing'\]; expected some of .*'label_smoothing'"):
        vpce.megatron.fuse_output_layer(model, label_smothing=0.1)
    assert not vpce.megatron.is_fused(model)
    model.output_layer.gather_output = True
    with pytest.raises(ValueError, match="not supported: an output layer with gather_output=True"):
        vpce.megatron.fuse_output_layer(model)
    model.output_layer.gather_output = False
    vpce.megatron.fuse_output_layer(model, mode="chunked")
    assert vpce.megatron.is_fused(model)
    tokens, position_ids, attention_mask, labels, _ = batch(0)
    with pytest.raises(ValueError, match="the chunked mode needs the forward's loss_mask"):
        model(tokens, position_ids, attention_mask, labels=labels)
    with pytest.raises(TypeError, match="log_prob_weights: expected a tensor of one weight per token or None, got "
                                        "float"):
        vpce.megatron.policy_objective(model, tokens, position_ids, attention_mask, labels=labels,
                                       log_prob_weights=0.5)
    vpce.megatron.unfuse_output_layer(model)
    assert not vpce.megatron.is_fused(model)
    assert "forward" not in vars(model) and "forward" not in vars(model.output_layer)
    dist.destroy_process_group()


def test_fused_gpt_model_trains_as_megatrons():
    spawn(worker, 2)


def test_multi_token_prediction_through_the_fused_head():
    spawn(mtp_worker, 2)


def test_label_smoothing_both_ways_through_the_fused_head():
    spawn(smoothing_worker, 2)


def rl_worker(rank, size, init_file):
    """vpce.megatron.log_probs_and_entropy and policy_objective (chunks of 16 tokens) through the
    fused head against vpce's RL outputs on Megatron's own logits (the same model's forward
    without labels), per-sequence temperatures, a padded vocabulary, non-uniform upstream
    gradients: the outputs within 1e-6 and every parameter's gradient within 2e-5 of the
    logits path's."""
    from test_megatron_core import megatron_init  # noqa: PLC0415

    import vpce.megatron  # noqa: PLC0415

    group = megatron_init(rank, size, init_file)
    cpu_patches()
    tokens, position_ids, attention_mask, labels, loss_mask = batch(0)
    labels = labels.masked_fill(loss_mask == 0, -100)  # prompt and padding positions
    temperature = torch.tensor([0.7, 1.3])
    g_lp = torch.rand(BATCH, SEQUENCE, generator=torch.Generator().manual_seed(5)) - 0.3
    g_h = torch.rand(BATCH, SEQUENCE, generator=torch.Generator().manual_seed(6)) * 0.1
    results = []
    for fused in (False, True):
        model = build(size, tied=False, bias=True, fusion=False)
        if fused:
            vpce.megatron.fuse_output_layer(model, valid_vocab_size=USED)
            log_prob, entropy = vpce.megatron.log_probs_and_entropy(model, tokens, position_ids, attention_mask,
                                                                    labels=labels, temperature=temperature)
        else:
            logits = model(tokens, position_ids, attention_mask)  # [b, s, V/R]: Megatron's output layer
            log_prob, entropy = vt.log_probs_and_entropy(logits, labels, temperature.unsqueeze(1).expand(labels.shape),
                                                         tp_group=group, valid_vocab_size=USED)
        assert log_prob.shape == (BATCH, SEQUENCE) and entropy.shape == (BATCH, SEQUENCE)
        (log_prob * g_lp + entropy * g_h).sum().backward()
        results.append((log_prob.detach(), entropy.detach(),
                        {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}))
    # The on-policy objective (the head's chunked mode, gradients in the forward).
    model = build(size, tied=False, bias=True, fusion=False)
    vpce.megatron.fuse_output_layer(model, valid_vocab_size=USED, token_block=8, chunk_tokens=16)
    objective, log_prob, entropy = vpce.megatron.policy_objective(
        model, tokens, position_ids, attention_mask, labels=labels, log_prob_weights=g_lp, entropy_weights=g_h,
        temperature=temperature)
    assert objective.dim() == 0 and not log_prob.requires_grad
    objective.backward()
    results.append((log_prob, entropy, {name: p.grad.clone() for name, p in model.named_parameters()
                                        if p.grad is not None}))
    (lp_a, h_a, grads_a), *others = results
    for lp_b, h_b, grads_b in others:
        assert relative_error(lp_b, lp_a) <= 1e-6 and relative_error(h_b, h_a) <= 1e-6
        assert torch.all(lp_b[loss_mask == 0] == 0) and torch.all(h_b[loss_mask == 0] == 0)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert relative_error(grads_b[name], grads_a[name]) <= 2e-5, name
    want = (lp_a.double() * g_lp.double() + h_a.double() * g_h.double()).sum()
    assert abs(objective.item() - want.item()) <= 1e-5 * abs(want.item())
    # Per-sequence weights [b] weigh their row (as the per-sequence temperature does; they were
    # aligned with the positions by PyTorch's broadcasting), and a 0-d temperature is one for all
    # (it raised IndexError in the wrapper).
    advantages = torch.tensor([0.5, -1.5])
    model = build(size, tied=False, bias=True, fusion=False)
    vpce.megatron.fuse_output_layer(model, valid_vocab_size=USED)
    objective, log_prob, _ = vpce.megatron.policy_objective(model, tokens, position_ids, attention_mask, labels=labels,
                                                            log_prob_weights=advantages, temperature=torch.tensor(0.8))
    log_prob_08, _ = vpce.megatron.log_probs_and_entropy(model, tokens, position_ids, attention_mask, labels=labels,
                                                         temperature=0.8)
    assert relative_error(log_prob, log_prob_08.detach()) <= 1e-6
    want = (log_prob.double() * advantages.double().unsqueeze(1)).sum()
    assert abs(objective.item() - want.item()) <= 1e-5 * abs(want.item())
    dist.destroy_process_group()


def test_rl_outputs_through_the_fused_head():
    spawn(rl_worker, 2)


def test_fuse_output_layer_refuses_what_it_does_not_support():
    spawn(refusal_worker, 1)
