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

    ``step`` upcasts each bf16 param that has a gradient, its gradient and its floating
    state tensors to fp32, runs the optimizer's own step, then writes the param back to bf16
    with the chosen rounding and the state tensors with round-to-nearest (into the same
    storages, so params that are views of a flat buffer stay views). Params of other dtypes
    are stepped untouched.

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
        pieces = [
            p
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None and p.dtype == torch.bfloat16
        ]
        saved = [self._upcast(p) for p in pieces]
        super().step()
        for p, (weight, grad, states) in zip(pieces, saved, strict=True):
            self._write_back(p, weight, grad, states)
        return loss

    # The base class's step already runs the optimizer's step hooks; this flag stops
    # Optimizer._patch_step_function (called again by load_state_dict) wrapping ours too.
    step.hooked = True

    def _upcast(self, p: torch.Tensor):
        """Put fp32 copies of ``p``, its gradient and its state in place; return the bf16
        originals to restore."""
        state = self.state[p]
        states = {k: v for k, v in state.items() if _rounded_state(k, v)}
        for k, v in states.items():
            state[k] = v.float()
        weight, grad = p.data, p.grad
        full = weight.float()
        if "kahan_comp" in state:
            full += state["kahan_comp"]  # the weight as the last step left it, before rounding
        p.data = full  # .data keeps p the same object, so optimizer.state[p] still finds it
        p.grad = grad.float()
        return weight, grad, states

    def _write_back(self, p: torch.Tensor, weight, grad, states) -> None:
        full = p.data  # (fp32) the optimizer's result
        state = self.state[p]
        if self.update_rounding == "stochastic":
            weight.copy_(_stochastic_round_(full))
        else:
            # Kahan's compensated sum y = u + c; t = w + y; c = y - (t - w), with the update
            # u = full - (w + c) already added by the step: t = bf16(full), c = full - t.
            weight.copy_(full)
            state["kahan_comp"] = full.sub_(weight)
        p.data, p.grad = weight, grad
        for k, v in list(state.items()):
            if _rounded_state(k, v) and v.dtype != torch.bfloat16:
                # Round to nearest: into the old storage, or a new bf16 tensor on the first step.
                state[k] = states[k].copy_(v) if k in states else v.to(torch.bfloat16)


@functools.cache
def _rounded_class(base: type) -> type:
    return type(f"Rounded{base.__name__}", (RoundedUpdate, base), {})


def _rounded_state(key, value) -> bool:
    # torch's own rule (Optimizer.load_state_dict): floating state follows the param's dtype,
    # except "step", which stays fp32 so it counts exactly.
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()


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
