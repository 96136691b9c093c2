"""``train.*``: the loop's length, batch, logging, device, compile and loss (conf/config.yaml)."""

from __future__ import annotations

from dataclasses import dataclass

from llm.config.require import require_choice, require_positive
from llm.errors import ConfigError

FUSED_LOSSES = ("off", "chunked", "liger", "cce")
COMPILE_MODES = ("default", "max-autotune", "reduce-overhead")


@dataclass
class TrainConfig:
    max_steps: int = 300  # the schedule's length
    stop_at_step: int | None = None  # end this invocation here (time-boxed jobs); resume later
    micro_batch_size: int = 16
    grad_accum_steps: int = 1
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    grad_clip: float = 1.0  # 0 disables clipping
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False
    # torch.compile's mode with train.compile: default, max-autotune (Inductor benchmarks
    # kernel configs at compile time) or reduce-overhead (CUDA graphs where the step allows
    # them; on a CPU it compiles as default).
    compile_mode: str = "default"  # default | max-autotune | reduce-overhead
    deterministic: bool = False
    # Which steps probe memory (llm/train/probes.py): step 1 and the logged steps (default),
    # every other step, or the same steps without the peak tracker. A probe is never timed.
    memory_tracking: str = "logged"  # logged | alternate | off
    # The largest tensors live at the tracked step's peak, each named by the op and the
    # line of llm/ that made it (summary.json ``memory_peak_tensors``); 0: not recorded
    # (naming every new storage slows a tracked step).
    peak_tensors: int = 0
    # On CUDA, the allocator's own record of each tracked step, replayed to its peak: the N
    # largest blocks live then, each with the line that asked for it (summary.json
    # ``memory_allocator_blocks``): memory no tensor holds (workspaces) shows here; 0: off.
    allocator_blocks: int = 0
    # The loss with the LM head fused in, never holding the (B*T, V) fp32 logits at once
    # (llm/train/loss.py): off (logits, then the loss), chunked (plain torch, any device),
    # liger (Liger-Kernel) or cce (Apple's cut-cross-entropy), both Triton on CUDA.
    fused_loss: str = "off"  # off | chunked | liger | cce
    # chunked: rows of logits at a time, each chunk x V fp32 (plus its compute-dtype matmul
    # output): 1024 rows of a 50k vocabulary are ~0.3 GB, 1/16 of a 16 x 1024 batch's.
    fused_loss_chunk: int = 1024

    def __post_init__(self) -> None:
        require_positive(
            "train",
            max_steps=self.max_steps,
            fused_loss_chunk=self.fused_loss_chunk,
            micro_batch_size=self.micro_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            log_every=self.log_every,
            eval_every=self.eval_every,
        )
        if self.stop_at_step is not None and not 0 < self.stop_at_step <= self.max_steps:
            raise ConfigError(
                f"train.stop_at_step={self.stop_at_step} must be in 1..train.max_steps={self.max_steps}"
            )
        if self.peak_tensors < 0:
            raise ConfigError(f"train.peak_tensors={self.peak_tensors} must be >= 0 (0: off)")
        if self.allocator_blocks < 0:
            raise ConfigError(
                f"train.allocator_blocks={self.allocator_blocks} must be >= 0 (0: off)"
            )
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip} must be >= 0 (0 disables)")
        require_choice("train", "device", self.device, ("auto", "cpu", "cuda"))
        if self.memory_tracking == "every_step":
            raise ConfigError(
                "train.memory_tracking=every_step is now alternate: a tracked step is never "
                "timed, so at most every other step is tracked; use train.memory_tracking=alternate"
            )
        require_choice(
            "train", "memory_tracking", self.memory_tracking, ("logged", "alternate", "off")
        )
        require_choice("train", "fused_loss", self.fused_loss, FUSED_LOSSES)
        require_choice("train", "compile_mode", self.compile_mode, COMPILE_MODES)
        if self.compile_mode != "default" and not self.compile:
            raise ConfigError(
                f"train.compile_mode={self.compile_mode} applies only to a compiled model; "
                "add train.compile=true"
            )
