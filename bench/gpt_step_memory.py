"""bench/gpt_step_memory.py: the peak memory of one training step of a megatron-core GPTModel
at a realistic shape (8 layers, H 1024, 16 heads, V 128256, sequence 2048, batch 1, tensor
parallelism 2 on gloo, fp32, on the CPU), with Megatron's own output layer and loss or with
vpce.megatron.fuse_output_layer (recompute or chunked). Each run is a fresh pair of
processes; each rank prints its peak resident memory (VmHWM, reset before the step) over the step, and its rise
over the memory held before the step (the model, the optimizer's states made by a first step),
and the logits' size, [s, b, V/2] fp32. A measurement, not a test (minutes on 2 cores).

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

LAYERS, HIDDEN, HEADS, VOCAB, SEQUENCE, BATCH = 8, 1024, 16, 128256, 2048, 1
SELECTIVE = os.environ.get("VPCE_BENCH_SELECTIVE_RECOMPUTE", "1") == "1"  # core attention recomputed


def reset_peak():
    """Linux: the peak resident memory (VmHWM) restarts from the current one."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(rank, size, init_file, loss_kind):
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
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import vpce.megatron

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, tensor_model_parallel_size=size, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=torch.float32,
                               recompute_granularity="selective" if SELECTIVE else None)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQUENCE)
    if loss_kind != "megatron":
        vpce.megatron.fuse_output_layer(model, mode=loss_kind.split("-")[1])
    # Per-parameter Adam (foreach=False), as a fused optimizer runs: the list-wide temporaries of
    # the foreach implementation (the size of every parameter) would set the step's peak.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
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
        backward_peak = peak_mib()
        reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), forward_end, backward_peak, peak_mib()

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
    logits = SEQUENCE * BATCH * (VOCAB // size) * 4 / 2**20
    print(f"{loss_kind:15s} rank {rank}: loss {loss:.6f}  step {seconds:5.1f} s  before {before:7.1f} MiB  "
          f"after the forward {forward_end:7.1f} MiB  peak "
          f"{peak:7.1f} (forward+backward {backward_peak:7.1f}, optimizer {optimizer_peak:7.1f}) MiB  rise "
          f"{peak - before:7.1f} MiB  (the logits: {logits:.1f} MiB)", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", choices=("megatron", "vpce-recompute", "vpce-chunked"), required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(2, os.path.join(directory, "init"), args.loss), nprocs=2)


if __name__ == "__main__":
    main()
