"""``attention.*``: the attention kernel and document masking (conf/attention/)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice
from llm.errors import ConfigError

SDPA_KERNELS = ("auto", "flash", "efficient", "cudnn", "math")


@dataclass
class AttentionConfig:
    # auto (the fastest the committed GPU records show for this device and shape, else sdpa:
    # llm/attention/auto.py) | eager | sdpa | flash_attn | flex | triton | xformers (BACKENDS)
    backend: str = "auto"
    # sdpa only: torch picks (auto) or this kernel alone; one that cannot run is refused.
    sdpa_kernel: str = "auto"  # auto | flash | efficient | cudnn | math
    # Packed documents (data.packing=true) attend only inside themselves, causal inside.
    document_mask: bool = False
    # With document_mask: positions (RoPE, learned) restart at 0 at each document.
    reset_positions: bool = False

    def __post_init__(self) -> None:
        require_choice("attention", "sdpa_kernel", self.sdpa_kernel, SDPA_KERNELS)
        if self.sdpa_kernel != "auto" and self.backend != "sdpa":
            raise ConfigError(
                f"attention.sdpa_kernel={self.sdpa_kernel} applies to attention=sdpa only, not "
                f"{self.backend}; drop it or use attention=sdpa"
            )
        if self.reset_positions and not self.document_mask:
            raise ConfigError(
                "attention.reset_positions=true restarts positions at packed documents, which "
                "needs attention.document_mask=true"
            )
