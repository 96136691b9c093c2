"""``optimizer.*``: one optimizer from the registry and its settings (conf/optimizer/)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError


@dataclass
class OptimizerConfig:
    """One optimizer from the registry (llm.optim.OPTIMIZERS; docs/optimizers.md). Fields an
    optimizer does not use are ignored by it; conf/optimizer/NAME.yaml holds its defaults."""

    name: str = "adamw"  # adamw | sgd | adafactor | lamb | lion | sophia | muon | adamw8bit
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd; muon's Nesterov momentum
    # None: adamw and muon's AdamW part fused where torch has the kernel (CUDA, CPU params),
    # else torch's foreach; sgd: torch picks. true/false are honoured where the kernel runs.
    fused: bool | None = None
    # lamb: Adam's bias correction of both moments, and the bound on ||w|| in the trust ratio
    bias_correction: bool = True
    trust_clip: float = 10.0
    # sophia: the clipping scale rho, and a Hessian estimate every k steps
    rho: float = 0.04
    hessian_every: int = 10
    # adafactor (torch.optim.Adafactor): beta2_t = 1 - t^beta2_decay, eps2, update clip d
    beta2_decay: float = -0.8
    eps2: float = 1e-3
    clip_threshold: float = 1.0
    # muon (llm/optim/muon.py on hidden matrices): Newton-Schulz steps and their dtype, lr
    # adjustment, and how sharded strategies orthogonalise: every rank gathers the whole
    # matrices it holds a piece of (gather, Moonlight's Distributed Muon) or one owner per
    # matrix computes it and scatters the pieces back (owner)
    ns_steps: int = 5
    ns_dtype: str = "bfloat16"  # bfloat16 (torch.optim.Muon's) | float32
    adjust_lr: str = "match_rms_adamw"  # match_rms_adamw | original
    distributed: str = "gather"  # gather | owner
    # adamw8bit: tensors smaller than this keep fp32 moments (bitsandbytes' min_8bit_size)
    min_8bit_size: int = 4096

    def __post_init__(self) -> None:
        require_positive(
            "optimizer",
            lr=self.lr,
            eps=self.eps,
            trust_clip=self.trust_clip,
            rho=self.rho,
            hessian_every=self.hessian_every,
            eps2=self.eps2,
            clip_threshold=self.clip_threshold,
            ns_steps=self.ns_steps,
            min_8bit_size=self.min_8bit_size,
        )
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay={self.weight_decay} must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)} must be two values in [0, 1)")
        if not -1.0 <= self.beta2_decay < 0.0:
            raise ConfigError(f"optimizer.beta2_decay={self.beta2_decay} must be in [-1, 0)")
        require_choice("optimizer", "adjust_lr", self.adjust_lr, ("match_rms_adamw", "original"))
        require_choice("optimizer", "ns_dtype", self.ns_dtype, ("bfloat16", "float32"))
        require_choice("optimizer", "distributed", self.distributed, ("gather", "owner"))
