"""bf16_pure's optimizer step: the update is computed in fp32, the weights stay bf16.

With no fp32 master copy, an update smaller than half a bf16 ulp of the weight
(|w| * 2^-9) is lost to round-to-nearest, so a weight that should drift slowly never moves
(Zamirai et al., 2020, "Revisiting BFloat16 Training"). Two cures, chosen by
``precision.update_rounding``:

- ``stochastic``: round up or down at random with the probabilities that make the rounded
  weight equal the fp32 result in expectation.
- ``kahan``: keep what rounding dropped in a bf16 compensation buffer per parameter
  (``optimizer.state[p]["kahan_comp"]``, so checkpoints carry it and memory accounting
  counts it as optimizer state) and add it back before the next update.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from llm.errors import ConfigError

MODES = ("stochastic", "kahan")
_LOW_16_BITS_CLEARED = -(1 << 16)  # 0xFFFF0000 as an int32 mask


class RoundedUpdate:
    """Gives a torch optimizer bf16_pure's rounded step, for any element-wise optimizer
    (AdamW, SGD, ...) over bf16 params, whole tensors or 1-D shard pieces alike.

    ``RoundedUpdate(optimizer, mode)`` returns the *same* optimizer object with its class
    swapped to a subclass of ``(RoundedUpdate, type(optimizer))``. Everything but ``step`` is
    the optimizer's own, so ``isinstance(opt, torch.optim.AdamW)`` holds, LR schedulers wrap
    its ``step`` as usual, and ``state_dict``/``load_state_dict``, ``zero_grad`` and DCP's
    ``get_state_dict``/``set_state_dict`` see the plain optimizer and its state. A separate
    wrapper object would have to mirror ``param_groups`` and ``state``, which
    ``load_state_dict`` replaces.

    ``step`` gives each bf16 param that has a gradient an fp32 shadow: a fresh leaf tensor
    holding the weight (plus Kahan's compensation), with the gradient and the floating state
    tensors upcast beside it. The shadows stand in for the params in ``param_groups`` and
    own their state while the optimizer's own step runs; then each shadow is written back
    into its param in place (``copy_``, with the chosen rounding) and the states are rounded
    to nearest into their old bf16 storages. The params are never touched otherwise, least
    of all their ``.data``: a param stays the very tensor DDP's reducer and FSDP's hooks are
    attached to, and a param that is a view of a flat buffer stays a view. Params of other
    dtypes are stepped untouched.

    Memory: between steps a bf16 param costs 2 bytes, its gradient 2, each state tensor 2
    (AdamW: 4 in all, Kahan 2 more). During ``step`` every such param additionally holds fp32
    copies of itself, its gradient and each state tensor: with AdamW 16 bytes per element
    (20 with Kahan's buffer) at once for the whole model, plus, while one param is written
    back, 4 bytes per element of int32 noise for stochastic rounding (Kahan's remainder is
    computed in place). All of it is freed when ``step`` returns: the saving is what stays
    resident through forward and backward, where activations peak.
    """

    update_rounding: str

    def __new__(cls, optimizer: torch.optim.Optimizer, mode: str):
        if mode not in MODES:
            raise ConfigError(f"precision.update_rounding={mode!r} must be one of {MODES}")
        optimizer.__class__ = _rounded_class(type(optimizer))
        return optimizer  # now a RoundedUpdate, so Python runs __init__ below on it

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str) -> None:
        # Not the optimizer's __init__: it already ran, and its params and state stay.
        self.update_rounding = mode

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            # Evaluated here, on the bf16 weights, rather than by the inner step on fp32 ones.
            with torch.enable_grad():
                loss = closure()
        shadows = {
            p: self._shadow(p)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and p.dtype == torch.bfloat16
        }
        originals = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [shadows.get(p, p) for p in group["params"]]
        try:
            super().step()
        finally:
            for group, params in zip(self.param_groups, originals, strict=True):
                group["params"] = params
        for p, shadow in shadows.items():
            self._write_back(p, shadow)
        return loss

    # The base class's step already runs the optimizer's step hooks; this flag stops
    # Optimizer._patch_step_function (called again by load_state_dict) wrapping ours too.
    step.hooked = True

    def _shadow(self, p: torch.Tensor) -> torch.Tensor:
        """An fp32 leaf with ``p``'s value, its gradient and its state, upcast."""
        state = self.state.pop(p, {})
        full = p.detach().float()
        if "kahan_comp" in state:
            full += state["kahan_comp"]  # the weight as the last step left it, before rounding
        full.grad = p.grad.float()
        # p's entry keeps its bf16 tensors, for write-back to round into their storages.
        self.state[p] = {k: v for k, v in state.items() if _rounded_state(k, v)}
        self.state[full] = {
            k: v.float() if _rounded_state(k, v) else v
            for k, v in state.items()
            if k != "kahan_comp"
        }
        return full

    def _write_back(self, p: torch.Tensor, shadow: torch.Tensor) -> None:
        full = _local(shadow)  # (fp32) the optimizer's result; a DTensor's own shard
        weight = _local(p)
        old, state = self.state.pop(p), self.state.pop(shadow)
        if self.update_rounding == "stochastic":
            weight.copy_(_stochastic_round_(full))
        else:
            # Kahan's compensated sum y = u + c; t = w + y; c = y - (t - w), with the update
            # u = full - (w + c) already added by the step: t = bf16(full), c = full - t.
            weight.copy_(full)
            state["kahan_comp"] = shadow.sub_(p)
        for k, v in list(state.items()):
            if _rounded_state(k, v) and v.dtype != torch.bfloat16:
                # Round to nearest: into the old storage, or a new bf16 tensor on the first step.
                state[k] = old[k].copy_(v) if k in old else v.to(torch.bfloat16)
        self.state[p] = state


@functools.cache
def _rounded_class(base: type) -> type:
    return type(f"Rounded{base.__name__}", (RoundedUpdate, base), {})


def _rounded_state(key, value) -> bool:
    # torch's own rule (Optimizer.load_state_dict): floating state follows the param's dtype,
    # except "step", which stays fp32 so it counts exactly.
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the values: a DTensor's local shard, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _stochastic_round_(x: torch.Tensor) -> torch.Tensor:
    """In place, fp32 -> fp32 that is exactly a bf16 (low 16 bits zero): add uniform random
    bits below bf16's mantissa to the bit pattern, then truncate. The magnitude rounds up
    with probability (distance to the bf16 below) / ulp, so the result is x in expectation."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    x.view(torch.int32).add_(noise).bitwise_and_(_LOW_16_BITS_CLEARED)
    return x


def wrap_optimizer(optimizer: torch.optim.Optimizer, update_rounding: str | None):
    """The optimizer as a precision policy needs it: unchanged, except under bf16_pure
    (``update_rounding`` set), where the update is applied with stochastic rounding or Kahan
    compensation."""
    if update_rounding is None:
        return optimizer
    return RoundedUpdate(optimizer, update_rounding)
