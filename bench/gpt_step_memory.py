"""bench/gpt_step_memory.py: the peak memory of one training step of a megatron-core GPTModel
at a realistic shape (8 layers, H 1024, 16 heads, V 128256, sequence 2048, batch 1, tensor
parallelism 2 on gloo, on the CPU), with Megatron's own output layer and loss or with
vpce.megatron.fuse_output_layer (recompute or chunked), in bf16 (the default) or fp32.

The attention is, by default, torch's scaled_dot_product_attention (its CPU flash kernel:
no [b, heads, s, s] scores), standing in for the fused attention (Transformer Engine, flash)
a GPU run takes: with Megatron's unfused local attention the scores' transients (about 0.5 GB
a layer here) set the step's peak in every layer's backward, after the logits are gone, which
is not what a GPU step looks like; `--attention local` measures that too.

Each run is a fresh pair of processes, glibc told to map every allocation of 64 KiB or more on
its own and unmap it when freed (MALLOC_MMAP_THRESHOLD_), so that the resident memory follows
the live tensors; each rank prints its peak resident memory (VmHWM, reset before the step)
over the forward and backward and over the optimizer's step, the rise over what was resident
before the step (the model, the optimizer's states made by a first step), and the logits'
size, [s, b, V/2] in the model's dtype. A measurement, not a test (minutes on 2 cores).

    python bench/gpt_step_memory.py --loss megatron
    python bench/gpt_step_memory.py --loss vpce-recompute
"""
import argparse
import contextlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from process_memory import reset_peak, status_mib

LAYERS, HIDDEN, HEADS, VOCAB, SEQUENCE, BATCH = 8, 1024, 16, 128256, 2048, 1
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def flash_like_attention():
    """Megatron's DotProductAttention computed by torch's scaled_dot_product_attention
    (causal; the CPU's flash kernel keeps no [b, heads, s, s] tensor), as a GPU's fused
    attention computes it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class FlashLikeAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            # [s, b, heads, hn] -> [b, heads, s, hn]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                       scale=self.softmax_scale)
            # [b, heads, s, hn] -> [s, b, heads * hn]
            return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    return FlashLikeAttention


def blocked_bf16_matmul():
    """torch.matmul and Tensor.matmul for bf16 operands, in fp32 blocks of 256 x 8192 of the product, each
    rounded to bf16 into the bf16 result: the same result's dtype and shape, and transients of
    a block (the operands' fp32 columns, up to 32 MiB here, and 8 MiB of product). PyTorch's CPU bf16 matmul on a CPU without AVX512-BF16 is a
    scalar fallback (0.3 GFLOP/s on the Zen 3: a step would take hours); Megatron's linear
    layers call them inside their autograd functions, so the patch reaches every layer and
    Megatron's output layer (vpce's head makes its own GEMMs)."""
    matmul = torch.matmul

    def patched(a, b, **kwargs):
        tracked = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
        if kwargs or tracked or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or b.dim() != 2:
            return matmul(a, b, **kwargs)
        rows = a.reshape(-1, a.shape[-1])
        out = torch.empty(rows.shape[0], b.shape[1], dtype=torch.bfloat16)
        for c in range(0, b.shape[1], 8192):
            columns = b[:, c:c + 8192].float()
            for r in range(0, rows.shape[0], 256):
                out[r:r + 256, c:c + 8192] = (rows[r:r + 256].float() @ columns).bfloat16()
        return out.view(*a.shape[:-1], b.shape[1])

    torch.matmul = patched
    torch.Tensor.matmul = patched


def worker(rank, size, init_file, loss_kind, dtype, attention):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as tp_random

    class Tracker:  # no CUDA RNG on the CPU; dropout is 0
        def fork(self, name=None):
            return contextlib.nullcontext()

        def add(self, name, seed):
            pass

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    tracker = Tracker()
    tp_random.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: tracker
    torch.cuda.current_device = lambda: "cpu"
    # Selective recomputation's checkpoint saves and restores the CUDA RNG state: the CPU's here.
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
    if dtype == "bf16":
        blocked_bf16_matmul()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import vpce.megatron

    torch.manual_seed(0)
    local = attention == "local"
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, tensor_model_parallel_size=size, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=DTYPES[dtype], bf16=dtype == "bf16",
                               pipeline_dtype=DTYPES[dtype],
                               recompute_granularity="selective" if local else None)  # local: scores recomputed
    spec = get_gpt_layer_local_spec()
    if not local:
        spec.submodules.self_attention.submodules.core_attention = flash_like_attention()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQUENCE)
    if dtype == "bf16":  # as Megatron's training wraps a bf16 model: bf16 activations, fp32 loss
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    if loss_kind != "megatron":
        vpce.megatron.fuse_output_layer(model, mode=loss_kind.split("-")[1])
    # The fused Adam (in place, as Megatron's fused optimizers): the per-parameter temporaries of
    # the unfused one (the size of the largest parameter, the embedding) or the list-wide ones
    # of the foreach one (every parameter) would set the step's peak for either loss.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    loss_mask = torch.ones(BATCH, SEQUENCE)
    positions = torch.arange(SEQUENCE).unsqueeze(0)
    mask = torch.ones(1, 1, SEQUENCE, SEQUENCE, dtype=torch.bool).tril().logical_not()

    def step():
        """(loss, the peak of the forward and backward, the peak of the optimizer's step)."""
        per_token = model(tokens, positions, mask, labels=labels, loss_mask=loss_mask)
        loss = (per_token * loss_mask).sum() / loss_mask.sum()
        forward_end = resident_mib()
        loss.backward()
        backward_peak = status_mib("VmHWM")
        reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), forward_end, backward_peak, status_mib("VmHWM")

    # Adam's states exist after a first step; the steps after it are the steady state.
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = resident_mib()
    reset_peak()
    start = time.monotonic()
    loss, forward_end, backward_peak, optimizer_peak = step()
    seconds = time.monotonic() - start
    peak = max(backward_peak, optimizer_peak)
    logits = SEQUENCE * BATCH * (VOCAB // size) * DTYPES[dtype].itemsize / 2**20
    print(f"{loss_kind:15s} {dtype} {attention} rank {rank}: loss {loss:.6f}  step {seconds:5.1f} s  before {before:7.1f} MiB  "
          f"after the forward {forward_end:7.1f} MiB  peak "
          f"{peak:7.1f} (forward+backward {backward_peak:7.1f}, optimizer {optimizer_peak:7.1f}) MiB  rise "
          f"{peak - before:7.1f} MiB  (the logits: {logits:.1f} MiB)", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", choices=("megatron", "vpce-recompute", "vpce-chunked"), required=True)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--attention", choices=("flash", "local"), default="flash",
                        help="flash: torch's SDPA (no s x s scores); local: Megatron's DotProductAttention, "
                             "selectively recomputed")
    args = parser.parse_args()
    # Every allocation of 64 KiB or more mapped on its own and unmapped when freed: the resident
    # memory then follows the live tensors (glibc reads these when the workers start).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "0"
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(2, os.path.join(directory, "init"), args.loss, args.dtype, args.attention), nprocs=2)


if __name__ == "__main__":
    main()
