"""DeepSpeed's own model-state estimators, printed beside ours for ``parallelism=deepspeed``.

Ours (``llm.estimate.states.paper_states``) is the ZeRO paper's arithmetic (Rajbhandari et
al. 2020, section 3.1): 16-bit parameters and gradients (2Φ each) and K·Φ of optimizer
states (K = 12 for mixed-precision Adam: fp32 master, momentum, variance), partitioned by
stage over N ranks. Per GPU, stage 2: 2Φ + (2 + K)Φ/N = 2Φ + 14Φ/N; stage 3: 16Φ/N.

DeepSpeed 0.19.8's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` (what its ``..._all_cold`` / ``..._all_live``
helpers print) count, without offload, 2Φ + 18Φ/N (stage 2) and 4·L + 18Φ/N (stage 3), L
being the parameters of the largest module (its own parameters, not its children's): an
fp32 gradient partition the paper leaves out (stage 2: +4Φ/N) and, at stage 3, +2Φ/N and
an fp32 buffer of the largest layer. Ours is therefore the smaller: at N = 8, stage 2,
3.75Φ against 4.25Φ (0.88x). Neither is what DeepSpeed's buffers hold after a step
(docs/recompute.md, "The memory estimator", gives the measured difference). DeepSpeed has
no estimator for stages 0 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# Per stage: DeepSpeed's figure without offload (mixed-precision Adam assumed), and ours
# (K bytes of optimizer state per parameter: 12 for mixed-precision Adam).
FORMULAS = {
    2: ("2Φ + 18Φ/N", "2Φ + (2+K)Φ/N"),
    3: ("4·L + 18Φ/N", "(4+K)Φ/N"),
}
FUNCTIONS = {
    2: "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs",
    3: "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs",
}


@dataclass
class DeepSpeedOwn:
    """DeepSpeed's own per-GPU model-state bytes for a stage, and where the figure came from:
    its function (``source`` "deepspeed X.Y.Z") or, where deepspeed is not importable, the
    formula transcribed here from 0.19.8 (``source`` "transcribed")."""

    stage: int
    bytes_per_gpu: int
    largest_layer: int
    source: str
    offload_optimizer: bool
    offload_params: bool

    @property
    def formula(self) -> str:
        if self.stage == 2 and self.offload_optimizer:
            return "2Φ"
        if self.offload_optimizer:
            return "4·L" if self.offload_params else "4·L + 2Φ/N"
        return FORMULAS[self.stage][0]

    @property
    def ours_formula(self) -> str:
        """paper_states' device bytes (offload moves only the K·Φ/N optimizer states)."""
        if self.offload_optimizer:
            return "2Φ + 2Φ/N" if self.stage == 2 else "4Φ/N"
        return FORMULAS[self.stage][1]

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "bytes_per_gpu": self.bytes_per_gpu,
            "largest_layer_params": self.largest_layer,
            "function": FUNCTIONS[self.stage],
            "source": self.source,
            "formula": self.formula,
            "ours_formula": self.ours_formula,
        }


def largest_layer(model: nn.Module) -> int:
    """DeepSpeed's L (its ``model_to_params``): the most parameters one module holds itself."""
    return max(
        (sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )


def _transcribed(stage: int, n: int, largest: int, gpus: int, nodes: int, opt: bool, par: bool):
    """DeepSpeed 0.19.8's GPU figures (stage_1_and_2.py, stage3.py), for when it is absent."""
    total = gpus * nodes
    if stage == 2:
        return 2 * n if opt else 2 * n + int(18 * n / total)
    if opt and par:
        return 4 * largest
    if opt:
        return 4 * largest + int(2 * n / total)
    return 4 * largest + int(18 * n / total)


def deepspeed_own(
    stage: int,
    n_params: int,
    largest: int,
    gpus_per_node: int,
    nodes: int = 1,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> DeepSpeedOwn | None:
    """DeepSpeed's own per-GPU model-state estimate for ``stage`` (None for 0 and 1, which
    it has none for): its function when deepspeed imports, else its 0.19.8 formula."""
    if stage not in FORMULAS:
        return None
    try:
        import deepspeed

        if stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import (
                estimate_zero2_model_states_mem_needs,
            )

            _, gpu = estimate_zero2_model_states_mem_needs(
                n_params, gpus_per_node, nodes, cpu_offload=offload_optimizer
            )
        else:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            _, gpu, _ = estimate_zero3_model_states_mem_needs(
                n_params,
                largest,
                gpus_per_node,
                nodes,
                cpu_offload=offload_optimizer,
                cpu_offload_params=offload_params,
            )
        source = f"deepspeed {deepspeed.__version__}"
    except Exception:  # not installed, or its import fails on this machine
        gpu = _transcribed(
            stage, n_params, largest, gpus_per_node, nodes, offload_optimizer, offload_params
        )
        source = "transcribed"
    return DeepSpeedOwn(stage, int(gpu), largest, source, offload_optimizer, offload_params)
