"""Tensor- and expert-parallel engines over torch.distributed: NCCL between GPUs, gloo on CPU and for control.

One engine spans ``tensor_parallel`` ranks (one process per GPU, on one node or, through LeaderWorkerSet, on
several).  Rank 0 runs everything a single-GPU engine runs (gRPC server, scheduler, runner, sampler, vision
tower); every other rank holds only its shard of the decoder and replays rank 0's forward passes::

    rank 0                                              ranks 1..N-1 (worker.serve_steps)
    runner: backend.begin_step(metadata)   --records-->  (nothing yet)
            model.forward(ids, positions, ...) --header over gloo, inputs over NCCL-->  begin_step + forward
              each layer: attention heads / MLP slice / experts of this rank, then all_reduce   (same, in step)
            model.compute_logits(hidden[rows]) --header + rows-->  compute_logits (vocab slice)
              vocab-parallel LM head: gather of the logit slices to rank 0, which samples

Modules: ``config`` (``ParallelConfig``, torch-free: the CLI imports it), ``sharding`` (which heads, experts,
intermediate rows and vocabulary rows a rank owns; pure arithmetic), ``layers`` (all-reduce wrappers, the
sharded MoE, the vocab-parallel LM head), ``model`` (a rank's model built at its local sizes, weights read slice
by slice from the same checkpoint), ``channel`` (the messages rank 0 broadcasts: one per model call),
``recording`` (rank 0's attention backend, which records what the workers need of a step), ``leader`` (rank 0's
model: each call goes to every rank), ``worker`` (the other ranks' loop), ``engine`` (process groups and launch,
KV sizing agreed by all ranks, the rank-0 ``EngineCore``).
"""
