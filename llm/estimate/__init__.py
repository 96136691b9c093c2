"""Memory and cost estimates before a run: activations from the shape (the Korthikanti
formula redone for our blocks), model states by strategy and precision, communication per
step, and a plan of what fits (``python -m llm.estimate``).

Which file answers what:
  __main__.py        the CLI: Hydra overrides plus estimate.*, a rich table, estimate.json
  estimator.py       one training estimate: model states + activations + comm, per rank
  states.py          parameters, gradients and optimizer states by strategy (meta shapes)
  activations.py     saved activations per layer and outside the blocks (Korthikanti)
  tp_terms.py        which activation terms tensor parallel divides
  stages.py          pipeline stages: in-flight activations and kept stage outputs
  gathered.py        FSDP2's gathered weights that autograd saves
  backward_peak.py   zero3 and fsdp: the rank's rows early in backward
  single_moments.py  one device: the rows at the end of forward, in backward, in the
                     optimizer step
  deepspeed_own.py   DeepSpeed's own model-state estimators, beside ours
  plan.py, layout.py, layout_estimate.py, schedule_steps.py, cluster.py
                     the plan: dp x tp x pp x ep x ZeRO x recompute layouts, their time
  device_profile.py, device_time.py
                     estimate.device: a device's measured rates, compute time shape by shape
  published_runs.py  the time model against Megatron-LM's Table 1 and BLOOM-176B
  startup.py         the estimate train.py prints before a run
  inference.py       estimate.mode=inference: a tp rank's weights, KV cache and working
                     memory for a batch and a context, and the batch / context that fit

The estimator CLI's room: may import every room but llm.run, llm.launch and llm.train.
"""

from llm.estimate.activations import (
    PAPER,
    ActivationEstimate,
    Kernels,
    estimate_activations,
    layer_terms,
    outside_terms,
)

__all__ = [
    "PAPER",
    "ActivationEstimate",
    "Kernels",
    "estimate_activations",
    "layer_terms",
    "outside_terms",
]
