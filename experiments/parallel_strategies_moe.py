"""The articles' expert-parallel (MoE) row in the parallel_strategies experiment: "only the
current expert is activated", at the cost of "All-to-All routing (O(experts))". Measured on
moe-tiny (4 blocks) on 4 ranks, from three follow-up sweeps:
- activations: top 2 of 8 experts against top 8 of 8 (every expert on every token), zero2
  at ep 2; the Trainer's saved-tensor count per block against the activation formula's
  (llm.estimate.activations, which counts the activated experts' rows only);
- model states: ddp at ep 4 against ep 1 of the same model (each rank holds a quarter of
  the experts). Under zero1-3 the expert slices are not sharded over their edp ranks, so
  ep saves less there (docs/parallel.md);
- all-to-all bytes per rank and step at 8 and at 16 experts (top 2, zero2, ep 2): a volume
  that is O(experts) doubles with them.
The articles give no figure for the first two: each is measured against our formula for
what their words come to, in its own table whose column says so.
"""

from __future__ import annotations

import torch

from experiments.claims import FORMULA_COLUMNS, Claim, Table, compare
from experiments.sweep import Job
from llm.estimate.activations import layer_terms
from llm.models import model_args, num_params
from llm.precision import resolve_precision

SOURCE = "design articles' table (docs/references.md), to be tested"
MODEL = "moe-tiny"
EP_LAYOUT = "zero2_dp4_ep2"  # activations and all-to-all
STATE_LAYOUTS = ("ddp_dp4_ep4", "ddp_dp4")  # model states: ep 4 against ep 1
CLAIMS = {
    "moe_activated": Claim(
        "moe_activated",
        "expert parallelism: only the current expert is activated",
        "activations of the routed experts only",
        SOURCE,
        0.05,
        "1 - a MoE block's saved activations at top 2 of 8 / at top 8 of 8 (the Trainer's "
        "saved-tensor count), against the formula's saving for the activated rows only",
    ),
    "moe_states": Claim(
        "moe_states",
        "expert parallelism splits the experts over the ranks",
        "1 - 1/ep of the experts' states",
        SOURCE,
        0.05,
        "1 - the largest rank's model states at ep 4 / at ep 1 (ddp, 4 ranks), against "
        "the experts' share of the parameters x (1 - 1/4)",
    ),
    "moe_comm": Claim(
        "moe_comm",
        "expert parallelism: All-to-All routing (O(experts))",
        "O(experts): 2x the bytes at 2x the experts",
        SOURCE,
        0.10,
        "all-to-all bytes per rank and step at 16 experts / at 8 (top 2, ep 2)",
    ),
}


def is_moe(job: Job) -> bool:
    return job.get("model.name") == MODEL


def follow_ups() -> list[list[str]]:
    return [
        [f"layout={EP_LAYOUT}", f"model={MODEL}", "model.moe.top_k=2,8"],
        [f"layout={EP_LAYOUT}", f"model={MODEL}", "model.moe.n_experts=16"],
        [f"layout={','.join(STATE_LAYOUTS)}", f"model={MODEL}"],
    ]


def _find(jobs: list[Job], strategy: str, ep: int, top_k: int = 2, experts: int = 8):
    return next(
        (
            j
            for j in jobs
            if is_moe(j)
            and j.get("parallelism.name") == strategy
            and int(j.get("parallelism.ep_size", 1)) == ep
            and int(j.get("model.moe.top_k") or 2) == top_k
            and int(j.get("model.moe.n_experts") or 8) == experts
        ),
        None,
    )


def _block_bytes(job: Job | None) -> int | None:
    if job is None or job.failed:
        return None
    return job.summary["activation_bytes_per_layer"][0]


def _formula_block(job: Job, top_k: int) -> int:
    """The activation formula's bytes for one block of the job's shape at ``top_k``."""
    moe = {"top_k": top_k, "n_experts": int(job.get("model.moe.n_experts") or 8)}
    args = model_args(MODEL, n_layers=int(job.get("model.n_layers")), vocab_size=257, moe=moe)
    policy = resolve_precision(job.summary["precision"], torch.device(job.summary["device"]))
    b, s = int(job.get("train.micro_batch_size")), int(job.get("data.seq_len"))
    return sum(layer_terms(args, b, s, policy, device=job.summary["device"]).values())


def _states(job: Job | None) -> int | None:
    if job is None or job.failed:
        return None
    return max(p["params_max"] + p["grads_max"] + p["optimizer_states_max"]
               for p in job.summary["memory_peak"])  # fmt: skip


def _a2a(job: Job | None) -> int | None:
    if job is None or job.failed or not job.summary.get("comm_bytes_per_step"):
        return None
    return max(sent.get("all_to_all", 0) for sent in job.summary["comm_bytes_per_step"])


def _expert_share(job: Job) -> float:
    """The experts' share of the model's parameters (moe-tiny at the job's depth)."""
    args = model_args(MODEL, n_layers=int(job.get("model.n_layers")), vocab_size=257)
    experts = args.n_layers * args.moe.n_experts * 3 * args.d_model * args.d_expert
    return experts / num_params(args)


def _follow_up_not_run(*jobs: Job | None) -> str | None:
    """The reason a row is not comparable when a job it needs did not run."""
    if any(j is None for j in jobs):
        return "the MoE follow-up sweeps did not run"
    return None


def formula_table(jobs: list[Job]) -> Table:
    """The activated-experts and expert-state savings, measured, against our formula."""
    top2, top8 = _find(jobs, "zero2", 2, 2), _find(jobs, "zero2", 2, 8)
    a2, a8 = _block_bytes(top2), _block_bytes(top8)
    activated = None if not a2 or not a8 else 1 - a2 / a8
    ok = top2 is not None and not top2.failed
    formula = 1 - _formula_block(top2, 2) / _formula_block(top2, 8) if ok else None
    rows = [
        compare(CLAIMS["moe_activated"], "moe-tiny zero2, ep 2, N=4", activated, formula,
                not_comparable=_follow_up_not_run(top2, top8)),
    ]  # fmt: skip
    ep4, ep1 = (_find(jobs, "ddp", ep) for ep in (4, 1))
    s4, s1 = _states(ep4), _states(ep1)
    saving = None if not s4 or not s1 else 1 - s4 / s1
    expected = _expert_share(ep1) * (1 - 1 / 4) if ep1 is not None else None
    rows.append(compare(CLAIMS["moe_states"], "moe-tiny ddp, ep 4 vs ep 1, N=4", saving,
                        expected, not_comparable=_follow_up_not_run(ep4, ep1)))  # fmt: skip
    return Table(
        "Expert parallel (MoE) memory against our formula",
        FORMULA_COLUMNS,
        rows,
        note="The articles give no figure: our formula is what their words come to here. "
        "moe_activated: 1 - the activation formula's bytes of a block at top 2 / at top 8 "
        "(llm.estimate.activations, the activated experts' rows only); moe_states: the "
        "experts' share of the parameters x (1 - 1/4). ours: measured on the follow-up "
        "sweeps' runs; ratio = ours / our formula.",
    )


def comm_rows(jobs: list[Job]) -> list[tuple]:
    """All-to-all bytes at 16 experts against 8: O(experts) doubles them."""
    top2, x16_job = _find(jobs, "zero2", 2, 2), _find(jobs, "zero2", 2, 2, 16)
    x8, x16 = _a2a(top2), _a2a(x16_job)
    grows = None if not x8 or not x16 else x16 / x8
    return [compare(CLAIMS["moe_comm"], "moe-tiny zero2, ep 2, 8 -> 16 experts, N=4", grows,
                    2.0, not_comparable=_follow_up_not_run(top2, x16_job))]  # fmt: skip
