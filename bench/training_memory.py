"""bench/training_memory.py: a process's resident memory over a training loop with each loss:
a tiny megatron-core GPTModel (2 layers, H 64, V 4096, sequence 256, batch 2; the logits
[256, 2, 2048] fp32 per rank, 4 MiB) trained with Adam at tensor parallelism 2 on gloo, its
loss Megatron's vocab_parallel_cross_entropy or vpce's (out of place or in place). Every
`--every` steps each rank prints its resident memory (and its growth since step 0) and
glibc's bytes in use and free-but-kept (mallinfo2). A measurement, not a test: resident
memory swings by tens of MiB between identical runs (glibc keeps freed holes), so run each
loss several times.

    python bench/training_memory.py --loss vpce-out-of-place --steps 150
"""
import argparse
import contextlib
import ctypes
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, SEQUENCE, BATCH = 4096, 256, 2


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def memory_mib():
    """(resident, glibc's bytes in use, glibc's free bytes it keeps), in MiB."""
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return resident / 2**20, (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def worker(rank, size, init_file, loss_kind, steps, every):
    torch.cuda.current_device = lambda: "cpu"  # megatron-core asks for it while building on the CPU
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    import vpce.torch as vt

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
    tp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()  # no CUDA RNG on the CPU
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=size, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQUENCE, parallel_output=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    group = parallel_state.get_tensor_model_parallel_group()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    labels = torch.randint(0, VOCAB, (SEQUENCE, BATCH), generator=generator)
    positions = torch.arange(SEQUENCE).unsqueeze(0).expand(BATCH, SEQUENCE)
    mask = torch.ones(1, 1, SEQUENCE, SEQUENCE, dtype=torch.bool).tril().logical_not()
    base = None
    for step in range(steps + 1):
        logits = model(tokens, positions, mask).transpose(0, 1).contiguous()  # [s, b, V/R]
        if loss_kind == "megatron":
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        else:
            loss = vt.vocab_parallel_cross_entropy(logits, labels, 0.0, group,
                                                   inplace_backward=loss_kind == "vpce-in-place")
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logits, loss
        if step % every == 0:
            gc.collect()
            mine = torch.tensor(memory_mib(), dtype=torch.float64)
            every_rank = [torch.zeros_like(mine) for _ in range(size)]
            dist.all_gather(every_rank, mine)
            base = every_rank if base is None else base
            if rank == 0:
                print(f"{loss_kind} step {step:4d}  " + "  ".join(
                    f"rank {r}: resident {now[0]:6.1f} (+{now[0] - then[0]:5.1f}) in use {now[1]:6.1f} "
                    f"kept free {now[2]:5.1f}" for r, (now, then) in enumerate(zip(every_rank, base))), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", choices=("megatron", "vpce-out-of-place", "vpce-in-place"), required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(worker, args=(2, os.path.join(directory, "init"), args.loss, args.steps, args.every), nprocs=2)


if __name__ == "__main__":
    main()
