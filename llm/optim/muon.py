"""Muon for the hidden matrices, AdamW for everything else, as one optimizer.

torch.optim.Muon (Jordan et al., 2024; torch's implementation) takes the Nesterov momentum
of a 2-D weight's gradient and replaces it by its nearest semi-orthogonal matrix (five
Newton-Schulz iterations), so every direction of the matrix moves by the same amount. It is
meant for the matrices inside transformer blocks only; embeddings, the output head and 1-D
params (norm gains, biases) stay with AdamW, as its users' recipes do (Keller Jordan's
modded-nanogpt, Moonlight). State: Muon's momentum (4 bytes per element) on hidden
matrices, AdamW's 8 bytes + a 4-byte step elsewhere.

``adjust_lr="match_rms_adamw"`` (Moonlight, Liu et al., 2025) scales Muon's update to the RMS
of an AdamW update, so one lr and one weight decay serve both halves and the scheduler
drives them together; ``"original"`` is Keller Jordan's max(1, rows/cols)^0.5 scaling, which
wants a much larger lr (~0.02) than AdamW's.

The two torch optimizers share this object's param groups and state: ``step`` points each
at its own groups (re-read every step, since ``load_state_dict`` replaces the group dicts)
and at this object's ``state``, so checkpoints, the LR scheduler and ``zero_grad`` see one
ordinary optimizer.
"""

from __future__ import annotations

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], muon: dict, adamw: dict):
        hidden = [g for g in groups if g.get("kind") == "hidden"]
        rest = [g for g in groups if g.get("kind") != "hidden"]
        self._muon = torch.optim.Muon(hidden, **muon) if hidden else None
        self._adamw = torch.optim.AdamW(rest, **adamw) if rest else None
        inner = [o for o in (self._muon, self._adamw) if o is not None]
        # The inner optimizers filled each group with their own defaults; these dicts
        # become this optimizer's groups.
        super().__init__([g for o in inner for g in o.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner, hidden in ((self._muon, True), (self._adamw, False)):
            if inner is None:
                continue
            inner.param_groups = [
                g for g in self.param_groups if (g.get("kind") == "hidden") == hidden
            ]
            inner.state = self.state
            inner.step()
        return loss
