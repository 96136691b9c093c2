"""Expert parallelism: each MoE layer's experts split over ``ep_size`` ranks, tokens moved to
their experts' ranks and back with ``all_to_all_single`` (DeepSpeed-MoE, GShard).

Ranks ``[g * ep, (g + 1) * ep)`` of the data-parallel group form expert-parallel group g;
rank ``i`` of a group holds experts ``[i * E / ep, (i + 1) * E / ep)``. Ranks with the same
place in different groups hold the same experts (the expert-data-parallel group, world /
ep ranks), and their expert gradients are summed over that group alone.

One module per job: ``exchange`` (the model side: counts and rows between ranks),
``shards`` (the strategy side: this rank's expert parameters), ``grads`` (their gradient
reduction), ``checkpoint`` (their DTensor view in checkpoints) and ``install`` (cutting the
weights to this rank's experts). Imports llm.models and llm.comm, nothing else of llm.
"""
