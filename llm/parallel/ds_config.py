"""DeepSpeed configs from our config groups, and a user's ds_config.json with its "auto"
values filled from ours, as the Hugging Face Trainer does (transformers' HfTrainerDeepSpeedConfig):
"auto" takes our value, an explicit value that contradicts ours is refused, the rest of the
user's file is kept as DeepSpeed's own settings.

Our groups stay the one source of truth for what the summary and W&B report (batch sizes,
clipping, optimizer hyperparameters, precision, ZeRO stage), hence the refusal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from llm.config import Config
from llm.errors import ConfigError
from llm.precision import REDUCE_DTYPES, LossScalerSettings, PrecisionPolicy

# Keys whose explicit value must equal ours (dotted paths into the ds_config), with the name of
# our setting for the error message.
MUST_MATCH = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "train_batch_size": "train.micro_batch_size*train.grad_accum_steps*dp_size",
    "gradient_clipping": "train.grad_clip",
    "optimizer.params.lr": "optimizer.lr",
    "optimizer.params.betas": "optimizer.betas",
    "optimizer.params.eps": "optimizer.eps",
    "optimizer.params.weight_decay": "optimizer.weight_decay",
    "fp16.enabled": "precision",
    "bf16.enabled": "precision",
    "zero_optimization.stage": "parallelism.zero_stage",
    "communication_data_type": "precision.reduce_dtype",
}
# Top-level keys a user's file gets from us when it leaves them out.
REQUIRED = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "fp16",
    "bf16",
    "communication_data_type",
)
# DeepSpeed reports to us: it must not print its own progress lines between ours.
QUIET = {"steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}


def comms_logger(count_comm: bool) -> dict:
    """DeepSpeed's comms logger counts collectives for take_sent(), and synchronises the device
    after every one of them to time it: on only with parallelism.count_comm."""
    return {"enabled": count_comm, "verbose": False, "prof_all": True, "debug": False}


def bucket_elements(bucket_cap_mb: float, dtype: torch.dtype) -> int:
    """DeepSpeed sizes its buckets in elements; ours (as DDP's) are MiB of gradient bytes.
    Rounded down to a multiple of 64: ZeRO-1/2 need the all-gather bucket aligned."""
    return max(64, int(bucket_cap_mb * 2**20) // dtype.itemsize // 64 * 64)


def fp16_section(cfg: Config) -> dict:
    """Our loss-scaler preset and overrides in DeepSpeed's fp16 vocabulary."""
    s = LossScalerSettings.from_config(cfg.precision)
    power = math.log2(s.initial_scale)
    if not power.is_integer():
        raise ConfigError(
            f"precision.initial_scale={s.initial_scale:g}: DeepSpeed's initial scale is a power "
            "of two (initial_scale_power); use e.g. 65536"
        )
    if (s.growth_factor, s.backoff_factor) != (2.0, 0.5):
        raise ConfigError(
            "precision.growth_factor/backoff_factor: DeepSpeed's scaler always doubles and halves; "
            "leave them unset with parallelism=deepspeed"
        )
    if not float(s.min_scale).is_integer():
        raise ConfigError(
            f"precision.min_scale={s.min_scale:g}: DeepSpeed's min_loss_scale is an integer"
        )
    return {
        "enabled": True,
        "loss_scale": 0 if s.dynamic else s.initial_scale,  # DeepSpeed: 0 = dynamic
        "initial_scale_power": int(power),
        "loss_scale_window": s.growth_interval,
        "hysteresis": s.hysteresis,
        "consecutive_hysteresis": s.consecutive_hysteresis,
        "min_loss_scale": int(s.min_scale),
    }


def zero_section(cfg: Config, precision: PrecisionPolicy, on_gpu: bool, d_model: int) -> dict:
    p = cfg.parallelism
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage == 0:
        return zero
    bucket = bucket_elements(p.bucket_cap_mb, precision.working_dtype)
    zero.update(
        reduce_bucket_size=bucket,
        allgather_bucket_size=bucket,
        contiguous_gradients=True,
        # Side streams overlap reduction with backward on a GPU; on CPU they only add copies.
        overlap_comm=on_gpu,
    )
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_section(p.offload_optimizer, p.nvme_path, on_gpu)
    if p.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket if p.prefetch else 0
        # Hugging Face's "auto": parameters this small stay whole on every rank, so each norm
        # gain is not gathered on its own.
        zero["stage3_param_persistence_threshold"] = 10 * d_model
        if p.offload_params != "none":
            zero["offload_param"] = _offload_section(p.offload_params, p.nvme_path, on_gpu)
        if cfg.optimizer.name == "muon":
            # DeepSpeed's stage-3 Muon refuses reduce-scatter: it all-gathers each whole
            # gradient to orthogonalise it (all-reduce, then keeps its partition).
            zero["reduce_scatter"] = False
    return zero


def _offload_section(tier: str, nvme_path: str | None, on_gpu: bool) -> dict[str, Any]:
    """DeepSpeed's offload_optimizer / offload_param section for our tier: pinned host
    buffers on a GPU; under nvme its swap folder (DeepSpeed makes its own subfolders there)
    and the async-I/O op (libaio) that does the swapping."""
    section: dict[str, Any] = {"device": tier, "pin_memory": on_gpu}
    if tier == "nvme":
        section["nvme_path"] = nvme_path
    return section


def generate(cfg: Config, dp_size: int, precision: PrecisionPolicy, on_gpu: bool, d_model: int):
    """The ds_config our groups describe."""
    t, o = cfg.train, cfg.optimizer
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * dp_size,
        "gradient_clipping": t.grad_clip,
        "fp16": fp16_section(cfg) if precision.name == "fp16" else {"enabled": False},
        "bf16": {"enabled": precision.name == "bf16"},
        "zero_optimization": zero_section(cfg, precision, on_gpu, d_model),
        # Gradients reduced in our reduce dtype (DeepSpeed's default is the gradients' own:
        # bf16 under bf16); ZeRO divides them by the dp size before the reduction.
        "communication_data_type": _dtype_name(precision.reduce_dtype),
        # Our registry's other optimizers (sgd, ...) are handed over as client optimizers.
        "zero_allow_untested_optimizer": True,
        **QUIET,
        "comms_logger": comms_logger(cfg.parallelism.count_comm),
    }
    if o.name == "adamw":
        # DeepSpeed builds it so that ZeRO-Offload gets its CPU Adam; elsewhere torch's AdamW,
        # the same arithmetic as every other strategy (no fused CUDA op is needed).
        params = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        params["torch_adam"] = cfg.parallelism.offload_optimizer == "none"
        ds["optimizer"] = {"type": "AdamW", "params": params}
    elif o.name == "muon":
        # DeepSpeed's own Muon (MuonWithAuxAdam, every ZeRO stage): Newton-Schulz on the
        # parameters tagged use_muon (our hidden matrices), its inline Adam on the rest. Its
        # update is scaled by max(1, rows/cols)^0.5, our adjust_lr=original (refused
        # otherwise, in checked_ds_config); "standard" is torch's quintic iteration.
        params = {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay}
        params |= {"betas": list(o.betas), "eps": o.eps, "ns_method": "standard"}
        ds["optimizer"] = {"type": "Muon", "params": params}
    elif o.name == "lamb" and on_gpu and cfg.parallelism.zero_stage == 0:
        # DeepSpeed's own fused LAMB (a CUDA op), on whole parameters: stage 0 only, since
        # its trust ratio over ZeRO's flat partitions would not be per parameter.
        params = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        params |= {"bias_correction": o.bias_correction}
        ds["optimizer"] = {"type": "Lamb", "params": params}
    if "optimizer" not in ds and cfg.parallelism.offload_optimizer != "none":
        # Our registry's optimizer stepped on the offloaded partitions (DeepSpeed refuses a
        # client optimizer under offload unless told it is meant).
        ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in REDUCE_DTYPES.items() if d == dtype)


def load_user_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"parallelism.deepspeed_config={path} does not exist; give a ds_config.json path"
        )
    try:
        user = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"parallelism.deepspeed_config={path} is not valid JSON ({exc}); fix the file"
        ) from None
    if not isinstance(user, dict):
        raise ConfigError(f"parallelism.deepspeed_config={path} must hold a JSON object")
    return user


def _get(tree: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def fill_auto(user: dict, ours: dict, path: str = "ds_config") -> dict:
    """The user's config with every "auto" replaced by our value; contradictions refused."""
    problems: list[str] = []

    def walk(node: dict, prefix: str) -> dict:
        out = {}
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = walk(value, f"{dotted}.")
            elif value == "auto":
                # Ours, or (e.g. stage-3 keys below stage 3) left out: DeepSpeed's default.
                if (mine := _get(ours, dotted)) is not None:
                    out[key] = mine
            else:
                out[key] = value
                mine = _get(ours, dotted)
                if dotted in MUST_MATCH and mine is not None and _differs(value, mine):
                    problems.append(f"{dotted}={value} but {MUST_MATCH[dotted]} gives {mine}")
        return out

    filled = walk(user, "")
    if "scheduler" in user:
        problems.append("it has a scheduler section; our scheduler group sets the learning rate")
    if "optimizer" in user and str(_get(user, "optimizer.type")).lower() != "adamw":
        problems.append(
            f"optimizer.type={_get(user, 'optimizer.type')}; only AdamW (optimizer=adamw) is mapped"
        )
    if "optimizer" in user and "optimizer" not in ours:
        problems.append("it has an optimizer section but our optimizer is not adamw")
    if problems:
        raise ConfigError(
            f"parallelism.deepspeed_config={path} contradicts the run config: "
            + "; ".join(problems)
            + ' (set such values to "auto" or change ours)'
        )
    return filled


def _differs(theirs, mine) -> bool:
    """Numbers compare by value (8 == 8.0), lists element-wise; what cannot be read as the
    same kind of value differs."""
    try:
        if isinstance(mine, list):
            return [float(x) for x in theirs] != [float(x) for x in mine]
        if isinstance(mine, bool):
            return not isinstance(theirs, bool) or theirs != mine
        if isinstance(mine, str):
            return theirs != mine
        return float(theirs) != float(mine)
    except (TypeError, ValueError):
        return True


def checked_ds_config(
    cfg: Config, precision: PrecisionPolicy, device: torch.device, dp_size: int, d_model: int
) -> dict:
    """The ds_config for this run, after everything parallelism=deepspeed refuses: callable
    before any rank starts (from llm.validate) as well as by the strategy."""
    if precision.name in ("bf16_pure", "fp8"):
        raise ConfigError(f"precision={precision.name} is not mapped onto DeepSpeed; use bf16")
    if precision.name == "fp16" and device.type != "cuda":
        raise ConfigError("DeepSpeed has no fp16 on CPU; use precision=bf16 or fp32")
    if cfg.parallelism.zero_stage == 0 and precision.working_dtype != torch.float32:
        raise ConfigError(
            "parallelism=deepspeed zero_stage=0 with 16-bit precision is DeepSpeed's DDP path, "
            "which has no checkpoint layout here; use parallelism.zero_stage>=1 or ddp"
        )
    if cfg.train.compile:
        raise ConfigError("train.compile=true does not apply to the DeepSpeed engine")
    if cfg.optimizer.name == "muon" and cfg.optimizer.adjust_lr != "original":
        raise ConfigError(
            "optimizer=muon under parallelism=deepspeed is DeepSpeed's Muon, which scales its "
            "update by max(1, rows/cols)^0.5: set optimizer.adjust_lr=original (and an lr for it, "
            "~0.02), or use parallelism=zero1-3 or fsdp for adjust_lr=match_rms_adamw"
        )
    return build_ds_config(cfg, dp_size, precision, device.type == "cuda", d_model)


def build_ds_config(
    cfg: Config, dp_size: int, precision: PrecisionPolicy, on_gpu: bool, d_model: int
) -> dict:
    """The ds_config this run hands to deepspeed.initialize."""
    ours = generate(cfg, dp_size, precision, on_gpu, d_model)
    path = cfg.parallelism.deepspeed_config
    if path is None:
        return ours
    filled = fill_auto(load_user_config(path), ours, path)
    # What the data loader, the Trainer and the precision policy do is fixed by our config:
    # a file that leaves these out gets ours, not DeepSpeed's defaults.
    for key in (*REQUIRED, *QUIET):
        filled.setdefault(key, ours[key])
    # take_sent() reads the comms logger: whether it runs (and syncs) is parallelism.count_comm's.
    filled["comms_logger"] = ours["comms_logger"]
    filled.setdefault("zero_optimization", {}).setdefault("stage", cfg.parallelism.zero_stage)
    if "optimizer" in filled and not on_gpu:
        # DeepSpeed's default Adam is a fused CUDA op; without a GPU use torch's (or CPU Adam
        # when offloading, where torch_adam is already false).
        filled["optimizer"].setdefault("params", {}).setdefault(
            "torch_adam", cfg.parallelism.offload_optimizer == "none"
        )
    return filled
