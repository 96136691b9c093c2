"""What each of Muon's distributed modes costs each rank per step, from the shard layout
alone: the payload its collectives carry (in llm/parallel/comm_counter.py's convention, so
that it can be set beside what the strategy's counter measured) and its Newton-Schulz FLOPs.

With Φ_h the elements of the hidden matrices, N ranks and balanced pieces:
- ``gather``: one all-gather whose output holds every rank's pieces, each padded to the
  longest: about Φ_h momentum elements (fp32), the ring sending (N-1)/N of it; every rank
  orthogonalises every matrix it holds a piece of, so matrices cut by a shard boundary are
  computed on two or more ranks.
- ``owner``: two all-to-alls: this rank's pieces to their owners (about Φ_h/N fp32 elements),
  then its owned matrices' results whole back in pieces (about Φ_h/N elements in the
  Newton-Schulz dtype); each matrix is orthogonalised once, the FLOPs split by the
  largest-first assignment.
"""

from __future__ import annotations

from llm.optim.muon import newton_schulz_flops
from llm.optim.shard_layout import ShardLayout, balanced_owners


def muon_costs(
    layout: ShardLayout, mode: str, steps: int, momentum_bytes: int = 4, ns_bytes: int = 2
) -> list[dict[str, int]]:
    """Per rank: ``comm`` {kind: payload bytes} and ``ns_flops``, for one step in ``mode``."""
    hidden = [i for i, pl in enumerate(layout.params) if pl.kind == "hidden"]
    held = [[i for i in hidden if layout.params[i].numel_held(r)] for r in range(layout.world)]
    flops = {i: newton_schulz_flops(layout.params[i].shape, steps) for i in hidden}
    lengths = [sum(layout.params[i].numel_held(r) for i in hidden) for r in range(layout.world)]
    if mode == "gather":
        payload = layout.world * max(lengths, default=0) * momentum_bytes
        return [
            {"comm": {"optim.all_gather": payload}, "ns_flops": sum(flops[i] for i in mine)}
            for mine in held
        ]
    owners = balanced_owners(flops, layout.world)
    out = []
    for r in range(layout.world):
        owned = [i for i in hidden if owners[i] == r]
        back = sum(layout.params[i].numel for i in owned) * ns_bytes
        out.append(
            {
                "comm": {"optim.all_to_all": lengths[r] * momentum_bytes + back},
                "ns_flops": sum(flops[i] for i in owned),
            }
        )
    return out
