"""The private-API guard: every private name of torch, DeepSpeed, bitsandbytes and Hydra that
the code uses, where, and how it is checked against the installed version, so that an
upgrade that removes or renames one fails here, by name, instead of deep in a run.

GUARD holds exactly what scripts/private_names.py finds (the scan's rules are in its
docstring); INTERNALS holds the internals whose names look public, which no scan can tell
from public API. Every check reads the real objects (attributes, signatures, op schemas,
config keys), never source text. docs/design.md ("Private APIs we rely on") says why the
main ones are needed."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from private_names import scan  # noqa: E402


@dataclass(frozen=True)
class Guard:
    where: str  # the files that use it, space-separated: exactly the scan's
    # Raises or returns False where the name is gone; None: reached from its dotted name.
    check: Callable[[], object] | None = None


def _reach(path: str):
    """What a dotted name names: its package, then attributes (importing submodules)."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        if inspect.ismodule(obj) and not hasattr(obj, part):
            importlib.import_module(".".join(parts[:i]))
        obj = getattr(obj, part)
    return obj


def _takes(path: str, keyword: str) -> None:
    fn = _reach(path)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a torch builtin: its aten op's schemas
        packet = getattr(torch.ops.aten, path.rsplit(".", 1)[1])
        names = {a.name for o in packet.overloads() for a in getattr(packet, o)._schema.arguments}
        assert keyword in names, f"no overload of {packet} takes {keyword}"
        return
    assert keyword in params, f"{path} takes no {keyword}= (it takes {list(params)})"


def _by_name(key: str) -> None:
    if key.endswith(" ="):  # we assign to it: what it replaces must be there
        _reach(key.removesuffix(" ="))
    elif key.endswith("=)"):
        _takes(*key.removesuffix("=)").split("("))
    else:
        _reach(key)


# ---- checks that need an object or a behaviour ---------------------------------------------
def _stage_meta_has_outputs():
    """llm.parallel.pipeline.rehearsal reads a stage's output metadata from its _stage_meta."""
    from torch.distributed.pipelining._utils import _StageMeta

    assert "outputs" in inspect.signature(_StageMeta).parameters


def _cdata_keys_a_storage():
    t = torch.zeros(4)
    key = t.untyped_storage()._cdata
    assert isinstance(key, int) and t[1:].untyped_storage()._cdata == key


def _resize_is_patchable():
    """The ledger re-reads sizes by replacing UntypedStorage.resize_, which ZeRO-3 and FSDP2
    call on the storages they free and refill: a call must reach the class attribute."""
    calls, original = [], torch.UntypedStorage.resize_
    torch.UntypedStorage.resize_ = lambda s, n: calls.append(n) or original(s, n)
    try:
        torch.zeros(4).untyped_storage().resize_(0)
    finally:
        torch.UntypedStorage.resize_ = original
    assert calls == [0]


def _sac_forward_mode_is_the_caching_mode():
    """op_sac on torch 2.11 swaps this object's class for a subclass reading ``storage``
    (test_op_sac_runs_its_torch_2_11_path_there runs it there)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        _CachingTorchDispatchMode,
        create_selective_checkpoint_contexts,
    )

    forward, _ = create_selective_checkpoint_contexts(lambda *a, **k: CheckpointPolicy.MUST_SAVE)
    assert type(forward) is _CachingTorchDispatchMode
    assert isinstance(forward.storage, dict)  # op -> the outputs it cached


def _optimizer_class_swaps():
    from llm.optim.rounded_update import RoundedUpdate

    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    opt = RoundedUpdate(torch.optim.AdamW([p], lr=0.1), "kahan")
    opt.step()
    assert isinstance(opt, RoundedUpdate) and isinstance(opt, torch.optim.AdamW)
    assert bool((p < 1).all())


def _compile_wraps_in_orig_mod():
    inner = nn.Linear(1, 1)
    wrapped = torch.compile(inner)
    assert wrapped._orig_mod is inner and "_orig_mod" in dict(wrapped.named_modules())


def _checkpoint_wrapper_names_its_child():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert "_checkpoint_wrapped_module" in dict(checkpoint_wrapper(nn.Linear(1, 1)).named_modules())


def _flash_attn_op(name: str) -> Callable[[], None]:
    def check():
        # flash-attn is an optional extra (pyproject's [flash], CUDA builds only).
        pytest.importorskip("flash_attn")
        assert hasattr(torch.ops.flash_attn, name)

    return check


def _multi_stage_schedules_lower_in_one_method():
    from llm.estimate.schedule_steps import PP_SINGLE_STAGE
    from llm.parallel.pipeline import SCHEDULES

    for name, cls in SCHEDULES.items():
        assert name in PP_SINGLE_STAGE or callable(cls._prepare_schedule_with_comms), name


def _bnb_quant_state_key():
    import bitsandbytes as bnb

    assert bnb.optim.optimizer.Optimizer8bit._FSDP_WRAPPED_QUANT_STATE_KEY == (
        "__bnb_optimizer_quant_state__"
    )


def _hp_mapping_fields():
    for stage in ("1", "2"):
        assert _deepspeed_probe()[stage]["hp_mapping"], f"ZeRO-{stage} params have no _hp_mapping"


def _budget_is_a_partitioner_key():
    config = torch._functorch.config
    with config.patch(activation_memory_budget=0.25):
        assert config.activation_memory_budget == 0.25


def _context_fn_reaches_checkpoint():
    """checkpoint_wrapper hands its other keywords to torch.utils.checkpoint.checkpoint."""
    from torch.utils.checkpoint import checkpoint

    assert "context_fn" in inspect.signature(checkpoint).parameters


def _params(path: str, names: list[str]) -> Callable[[], None]:
    return lambda: _assert_params(_reach(path), names)


def _assert_params(fn, names: list[str]) -> None:
    assert list(inspect.signature(fn).parameters)[: len(names)] == names


OPTIM = "llm/optim/lamb.py llm/optim/lion.py llm/optim/sophia.py"
WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
ATEN = "torch.ops.aten"
FUNCOL = "torch.ops._c10d_functional"
DS_GROUPS = "deepspeed.utils.groups"
SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def _one_stage_meta_path() -> bool:
    """torch 2.13 exchanges stage metadata through ``_recv_meta``; torch 2.11 through
    ``_shape_inference``'s object receive. The rehearsal overrides both."""
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, "_recv_meta") or hasattr(PipelineStage, "_shape_inference")


GUARD = {
    # Names in strings: the wrappers' infixes stripped from module names (DDP's "module" is
    # public), SAC's flash_attn ops, a pipeline-schedule hook overridden through type().
    "'_checkpoint_wrapped_module'": Guard(
        "llm/models/weights.py llm/precision/fp8/linear.py", _checkpoint_wrapper_names_its_child
    ),
    "'_orig_mod'": Guard(
        "llm/models/weights.py llm/precision/fp8/linear.py", _compile_wraps_in_orig_mod
    ),
    "'_fsdp_wrapped_module'": Guard(
        "llm/precision/fp8/linear.py",
        lambda: (
            _reach("torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE")
            == "_fsdp_wrapped_module"
        ),
    ),
    "'_flash_attn_forward'": Guard(
        "llm/recompute/op_sac.py", _flash_attn_op("_flash_attn_forward")
    ),
    "'_flash_attn_varlen_forward'": Guard(
        "llm/recompute/op_sac.py", _flash_attn_op("_flash_attn_varlen_forward")
    ),
    "'_prepare_schedule_with_comms'": Guard(
        "llm/estimate/schedule_steps.py", _multi_stage_schedules_lower_in_one_method
    ),
    # Private attributes of objects handed to us: storages (the ledger's key), views' bases,
    # op overloads' schemas, torch.compile's wrapper, DeepSpeed's and bitsandbytes' state.
    "*._cdata": Guard("llm/memory/live.py", _cdata_keys_a_storage),
    "*._base": Guard("llm/memory/activations.py", lambda: torch.zeros(2)[1:]._base is not None),
    "*._schema.name": Guard(
        "llm/recompute/op_sac.py", lambda: torch.ops.aten.mm.default._schema.name == "aten::mm"
    ),
    "*._orig_mod": Guard("llm/optim/factory.py", _compile_wraps_in_orig_mod),
    "*._FSDP_WRAPPED_QUANT_STATE_KEY": Guard("llm/parallel/zero/state.py", _bnb_quant_state_key),
    "*._hp_mapping": Guard("llm/parallel/ds_checkpoint.py", _hp_mapping_fields),
    "*._get_optimizer_loss_scale": Guard(
        "llm/parallel/deepspeed.py",
        lambda: callable(
            _reach("deepspeed.runtime.engine.DeepSpeedEngine._get_optimizer_loss_scale")
        ),
    ),
    # An object's class swapped for a subclass of its own: SAC's caching mode on torch 2.11,
    # an optimizer given rounded bf16 updates.
    "*.__class__ = _HandOverCached": Guard(
        "llm/recompute/op_sac.py", _sac_forward_mode_is_the_caching_mode
    ),
    "*.__class__ = _rounded_class(type(optimizer))": Guard(
        "llm/optim/rounded_update.py", _optimizer_class_swaps
    ),
    # Patches: the ledger's resize_, DeepSpeed's comm logger, a benchmark's byte counter.
    "torch.UntypedStorage.resize_ =": Guard("llm/memory/live.py", _resize_is_patchable),
    "deepspeed.comm.comms_logger.enabled =": Guard("llm/parallel/deepspeed.py"),
    "torch.distributed.all_to_all_single =": Guard("benchmarks/moe_peer.py"),
    # A rehearsal's pipeline stage answers for its neighbours' shapes (llm.rehearse).
    "*._stage_meta.outputs": Guard("llm/parallel/pipeline/rehearsal.py", _stage_meta_has_outputs),
    "torch.distributed.pipelining.PipelineStage._recv_meta": Guard(
        "llm/parallel/pipeline/schedule.py",
        _params("torch.distributed.pipelining.PipelineStage._recv_meta", ["self", "src_stage"]),
    ),
    # torch 2.11's path (the GPU machines' torch): shape inference receives an object, which
    # the rehearsal answers by patching the receive while it runs. torch 2.13 has the
    # _recv_meta path instead, so one of the two must exist.
    "torch.distributed.pipelining.PipelineStage._shape_inference": Guard(
        "llm/parallel/pipeline/schedule.py", _one_stage_meta_path
    ),
    "torch.distributed.recv_object_list =": Guard(
        "llm/parallel/pipeline/rehearsal.py", lambda: callable(dist.recv_object_list)
    ),
    **{
        f"torch.distributed.pipelining._utils.{name}": Guard("llm/parallel/pipeline/rehearsal.py")
        for name in (
            "_StageBackwardMeta",
            "_StageBackwardMeta(backward_metas=)",
            "_StageForwardMeta",
            "_StageForwardMeta(forward_metas=)",
            "_TensorMeta",
        )
    },
    # The fake process group of llm.rehearse (and of many tests' fake tp mesh).
    "torch.testing._internal.distributed.fake_pg.FakeStore": Guard("llm/rehearse/rank.py"),
    # train.allocator_blocks: the CUDA allocator's history of a tracked step, and its trace.
    **{
        f"torch.cuda.memory._record_memory_history{kw}": Guard("llm/memory/allocator_blocks.py")
        for kw in ("", "(context=)", "(device=)", "(enabled=)", "(max_entries=)", "(stacks=)")
    },
    "torch.cuda.memory._snapshot": Guard("llm/memory/allocator_blocks.py"),
    # DeepSpeed's process groups: released between runs; the expert groups a benchmark reads.
    f"{DS_GROUPS}._release_process_group_references": Guard("llm/parallel/deepspeed.py"),
    f"{DS_GROUPS}._get_expert_parallel_group": Guard("benchmarks/moe_peer.py"),
    f"{DS_GROUPS}._get_expert_parallel_rank": Guard("benchmarks/moe_peer.py"),
    # Hydra's sweep grammar, for the experiments' job lists.
    SWEEPER: Guard("experiments/runner.py"),
    f"{SWEEPER}.split_arguments": Guard("experiments/runner.py"),
    f"{SWEEPER}.split_arguments(max_batch_size=)": Guard("experiments/runner.py"),
    # Our optimizers' multi-tensor steps; the gradient clip and unscale of every step.
    "torch._foreach_add_": Guard(OPTIM),
    "torch._foreach_add_(alpha=)": Guard("llm/optim/lion.py llm/optim/sophia.py"),
    "torch._foreach_addcmul_": Guard("llm/optim/lamb.py"),
    "torch._foreach_addcmul_(value=)": Guard("llm/optim/lamb.py"),
    "torch._foreach_clamp_max_": Guard("llm/optim/sophia.py"),
    "torch._foreach_clamp_min_": Guard("llm/optim/sophia.py"),
    "torch._foreach_div": Guard("llm/optim/lamb.py llm/optim/sophia.py"),
    "torch._foreach_lerp_": Guard("llm/optim/lamb.py"),
    "torch._foreach_mul": Guard(OPTIM),
    "torch._foreach_mul_": Guard(f"{OPTIM} llm/parallel/step.py"),
    "torch._foreach_norm": Guard("llm/optim/lamb.py"),
    "torch._foreach_sign_": Guard("llm/optim/lion.py"),
    "torch._foreach_sqrt": Guard("llm/optim/lamb.py"),
    # MoE experts in one kernel; INT4 weight-only matmuls (CUDA and CPU kernels).
    "torch._grouped_mm": Guard("llm/models/moe.py"),
    "torch._grouped_mm(offs=)": Guard("llm/models/moe.py"),
    "torch._convert_weight_to_int4pack": Guard("llm/inference/quantize.py"),
    "torch._convert_weight_to_int4pack_for_cpu": Guard("llm/inference/quantize.py"),
    "torch._weight_int4pack_mm": Guard("llm/inference/quantize.py"),
    "torch._weight_int4pack_mm_for_cpu": Guard("llm/inference/quantize.py"),
    # torch.compile's caches between the attention benchmark's shapes.
    "torch._dynamo.reset": Guard("benchmarks/gpu_pass/attention.py"),
    # Recompute: the budget policy's partitioner key; torchtitan's checkpoint wrapper.
    "torch._functorch.config.patch": Guard("llm/recompute/policies.py"),
    "torch._functorch.config.patch(activation_memory_budget=)": Guard(
        "llm/recompute/policies.py", _budget_is_a_partitioner_key
    ),
    f"{WRAPPER}.CheckpointImpl": Guard("llm/recompute/op_sac.py llm/recompute/policies.py"),
    f"{WRAPPER}.CheckpointImpl.NO_REENTRANT": Guard(
        "llm/recompute/op_sac.py llm/recompute/policies.py"
    ),
    f"{WRAPPER}.checkpoint_wrapper": Guard("llm/recompute/op_sac.py llm/recompute/policies.py"),
    f"{WRAPPER}.checkpoint_wrapper(checkpoint_impl=)": Guard(
        "llm/recompute/op_sac.py llm/recompute/policies.py"
    ),
    f"{WRAPPER}.checkpoint_wrapper(context_fn=)": Guard(
        "llm/recompute/op_sac.py", _context_fn_reaches_checkpoint
    ),
    # op_sac: the attention kernels whose outputs it keeps; on torch 2.11 its caching mode.
    f"{ATEN}._scaled_dot_product_flash_attention.default": Guard("llm/recompute/op_sac.py"),
    f"{ATEN}._scaled_dot_product_flash_attention_for_cpu.default": Guard("llm/recompute/op_sac.py"),
    f"{ATEN}._scaled_dot_product_efficient_attention.default": Guard("llm/recompute/op_sac.py"),
    f"{ATEN}._scaled_dot_product_cudnn_attention.default": Guard("llm/recompute/op_sac.py"),
    f"{ATEN}._efficient_attention_forward.default": Guard("llm/recompute/op_sac.py"),
    "torch.utils.checkpoint._CachingTorchDispatchMode": Guard("llm/recompute/op_sac.py"),
    "torch.utils.checkpoint._CachingTorchDispatchMode.__torch_dispatch__": Guard(
        "llm/recompute/op_sac.py"
    ),
    "torch.utils.checkpoint._CachingTorchDispatchMode.storage.get": Guard(
        "llm/recompute/op_sac.py", _sac_forward_mode_is_the_caching_mode
    ),
    # The live-storage ledger's and the communication counter's dispatch modes; the
    # functional collectives that DTensor and FSDP2 issue, counted.
    "torch.utils._python_dispatch.TorchDispatchMode": Guard(
        "llm/memory/live.py llm/parallel/comm_counter.py"
    ),
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass": Guard("llm/memory/live.py"),
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass_type": Guard("llm/memory/live.py"),
    "torch.utils._pytree.tree_leaves": Guard("llm/train/checkpoint_files.py"),
    FUNCOL: Guard("llm/parallel/comm_counter.py"),
    f"{FUNCOL}.all_gather_into_tensor.default": Guard("llm/parallel/comm_counter.py"),
    f"{FUNCOL}.all_reduce.default": Guard("llm/parallel/comm_counter.py"),
    f"{FUNCOL}.all_reduce_.default": Guard("llm/parallel/comm_counter.py"),
    f"{FUNCOL}.reduce_scatter_tensor.default": Guard("llm/parallel/comm_counter.py"),
    "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather": Guard(
        "llm/parallel/comm_counter.py"
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter": Guard(
        "llm/parallel/comm_counter.py"
    ),
    **{
        f"torch.distributed.fsdp._fully_shard._fsdp_api.{kind}.allocate": Guard(
            "llm/parallel/comm_counter.py",
            _params(
                f"torch.distributed.fsdp._fully_shard._fsdp_api.{kind}.allocate",
                ["self", "size", "dtype", "device"],
            ),
        )
        for kind in ("AllGather", "ReduceScatter")
    },
    # Backward's end (the peak tracker's refresh, DeepSpeed's gradient sample).
    "torch.autograd.Variable._execution_engine.queue_callback": Guard(
        "llm/memory/peak.py llm/parallel/deepspeed.py"
    ),
    # Parallelism: replication with FSDP2's machinery, FSDP's split-dim placement, expert
    # slices kept out of DDP's all-reduce, a rank's rows of a checkpoint, our TP style.
    "torch.distributed._composable.replicate_with_fsdp.replicate": Guard(
        "llm/parallel/ddp_replicate.py"
    ),
    "torch.distributed.tensor.placement_types._StridedShard": Guard(
        "llm/parallel/experts/checkpoint.py llm/parallel/fsdp.py"
    ),
    # An expert tensor sharded over (edp, ep): the ep split outside, edp's inside it.
    "torch.distributed.tensor.placement_types._StridedShard(split_factor=)": Guard(
        "llm/parallel/experts/checkpoint.py"
    ),
    "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model": Guard(
        "llm/parallel/ddp.py"
    ),
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": Guard(
        "llm/models/weights.py"
    ),
    "torch.distributed.tensor.parallel.style.ParallelStyle._apply": Guard(
        "llm/parallel/tensor_parallel.py",
        _params(
            "torch.distributed.tensor.parallel.style.ParallelStyle._apply",
            ["self", "module", "device_mesh"],
        ),
    ),
    # The bounded checkpoint writer hands it a queue of its own files.
    "torch.distributed.checkpoint.FileSystemWriter._write_data": Guard(
        "llm/train/bounded_writer.py",
        _params(
            "torch.distributed.checkpoint.FileSystemWriter._write_data",
            ["self", "planner", "file_queue"],
        ),
    ),
}


def _sac_policy_sees_the_output():
    """torch 2.12+: the policy is called after the op, with its output (2.11: before it)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    seen = []

    def policy(ctx, func, *args, **kwargs):
        seen.append((ctx.is_recompute, ctx.op_output))
        return CheckpointPolicy.MUST_SAVE

    x = torch.ones(2, 2, requires_grad=True)
    contexts = functools.partial(create_selective_checkpoint_contexts, policy)
    checkpoint(lambda t: (t @ t).sum(), x, use_reentrant=False, context_fn=contexts).backward()
    assert (False, None) not in seen and any(isinstance(o, torch.Tensor) for _, o in seen)


def _bnb_adamw8bit_internals():
    """The sharded AdamW8bit overrides these three, reads ``args.min_8bit_size`` and sets the
    config key of the same name; ZeRO keeps the quantisation tensors whole."""
    import bitsandbytes as bnb

    cls = bnb.optim.optimizer.Optimizer8bit
    for name in ("get_config", "init_state", "update_step"):
        assert callable(getattr(cls, name)), name
    _assert_params(cls.init_state, ["self", "group", "p", "gindex", "pindex"])
    opt = bnb.optim.AdamW8bit([nn.Parameter(torch.zeros(4))])
    assert isinstance(opt.args.min_8bit_size, int)
    assert "min_8bit_size" in opt.get_config(0, 0, opt.param_groups[0])
    quantised = {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}
    assert quantised <= opt.non_castable_tensor_keys


DCP = "torch.distributed.checkpoint"
STAGE = "torch.distributed.pipelining.PipelineStage"
# Internals whose names look public: (where, check).
# The DeepSpeed attributes are checked on real engines by
# test_deepspeed_optimizers_hold_what_we_read.
INTERNALS = {
    "SelectiveCheckpointContext.op_output, .is_recompute": (
        "llm/recompute/op_sac.py",
        _sac_policy_sees_the_output,
    ),
    f"{DCP}.default_planner.create_default_local_load_plan": (
        "llm/parallel/flat_shards.py",
        _params(
            f"{DCP}.default_planner.create_default_local_load_plan",
            ["state_dict", "metadata", "strict"],
        ),
    ),
    f"{DCP}.planner_helpers.create_read_items_for_chunk_list": (
        "llm/parallel/flat_shards.py",
        _params(
            f"{DCP}.planner_helpers.create_read_items_for_chunk_list",
            ["fqn", "checkpoint_md", "local_chunks"],
        ),
    ),
    # Every backward of a stage inside the strategy's grad_sync (a method of the private
    # _PipelineStageBase, overridden).
    f"{STAGE}.backward_maybe_with_nosync": (
        "llm/parallel/pipeline/schedule.py",
        _params(
            f"{STAGE}.backward_maybe_with_nosync",
            ["self", "backward_type", "bwd_kwargs", "last_backward"],
        ),
    ),
    f"{STAGE}.get_fwd_send_ops, get_bwd_send_ops": (
        "llm/parallel/pipeline/schedule.py",  # wrapped per stage to count the bytes it sends
        lambda: (
            callable(_reach(f"{STAGE}.get_fwd_send_ops"))
            and callable(_reach(f"{STAGE}.get_bwd_send_ops"))
        ),
    ),
    "bitsandbytes Optimizer8bit, AdamW8bit.args.min_8bit_size": (
        "llm/optim/adamw8bit.py llm/parallel/zero/state.py",
        _bnb_adamw8bit_internals,
    ),
}


@functools.cache
def _scan() -> dict[str, list[str]]:
    return scan()


def _files(places: list[str]) -> set[str]:
    return {p.rsplit(":", 1)[0] for p in places}


def test_the_guard_lists_every_private_name_the_code_uses():
    found = _scan()
    new = [f"{k} ({', '.join(found[k])})" for k in found if k not in GUARD]
    assert not new, "private names not in the guard: add each to GUARD\n" + "\n".join(new)
    gone = [k for k in GUARD if k not in found]
    assert not gone, f"the code no longer uses these: remove them from GUARD: {gone}"
    where = {k: _files(v) for k, v in found.items()}
    moved = {k: sorted(f) for k, f in where.items() if f != set(GUARD[k].where.split())}
    assert not moved, f"used in other files than GUARD says: {moved}"


def test_every_name_the_scan_cannot_reach_by_name_has_a_check():
    unreachable = [k for k, g in GUARD.items() if g.check is None and k[0] in "*'"]
    assert not unreachable


@pytest.mark.parametrize("key", list(GUARD))
@pytest.mark.slow
def test_private_name_is_there(key):
    check = GUARD[key].check
    if check is None:
        _by_name(key)
    else:
        assert check() is not False, key


@pytest.mark.parametrize("name", list(INTERNALS))
def test_internal_name_is_there(name):
    assert INTERNALS[name][1]() is not False, name


def test_every_package_the_guard_reaches_is_required_and_installed():
    """A missing package fails here (no skip); flash-attn, an optional extra, is the only skip."""
    lines = (REPO / "requirements.txt").read_text().splitlines()
    required = {re.split(r"[=<>;\s]", s)[0].lower() for s in lines if s and not s.startswith("#")}
    installed = importlib.metadata.packages_distributions()
    tops = {k.split(".")[0] for k in GUARD if k[0] not in "*'"} | {"bitsandbytes", "deepspeed"}
    for top in sorted(tops):
        dists = {d.lower() for d in installed.get(top, [])}
        assert dists & required, f"{top}: not installed, or not in requirements.txt"
        importlib.import_module(top)


# ---- DeepSpeed: attributes of its ZeRO optimizers and parameters, on real engines ----------
DS_PROBE = """
import json, sys
import deepspeed, torch
import deepspeed.comm.torch as ds_torch

names = json.loads(sys.argv[1])
ds_torch.build_shm_op = lambda: None  # a C++ build (minutes on 2 cores) no attribute needs
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for stage in (1, 2, 3):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.randn(1, 8, dtype=torch.bfloat16)).float().sum())
    p = next(engine.module.parameters())
    m = getattr(p, "_hp_mapping", None)
    out[stage] = {
        "optimizer": [a for a in names["optimizer"] if hasattr(engine.optimizer, a)],
        "param": [a for a in names["param"] if hasattr(p, a)],
        "hp_mapping": m is not None and isinstance(m.hp_fragment, torch.Tensor) and all(
            isinstance(n, int) for n in (
                m.lp_fragment_address.start, m.lp_fragment_address.numel,
                m.hp_fragment_address.start)),
    }
print(json.dumps(out))
"""
# Attribute -> the ZeRO stages that must have it (llm/parallel/ds_checkpoint.py reads them).
DS_OPTIMIZER = {
    "fp32_partitioned_groups_flat": (3,),
    "fp16_partitioned_groups_flat": (3,),
    "grad_position": (3,),
    "sub_group_to_group_id": (3,),
    "get_param_id": (3,),
}
DS_PARAM = {"ds_tensor": (3,), "ds_numel": (3,), "ds_process_group": (3,)}


@functools.cache
def _deepspeed_probe() -> dict:
    from llm.parallel.deepspeed import GRAD_BUFFERS

    names = {"optimizer": [*DS_OPTIMIZER, *GRAD_BUFFERS], "param": list(DS_PARAM)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    done = subprocess.run(
        [sys.executable, "-c", DS_PROBE, json.dumps(names)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_deepspeed_optimizers_hold_what_we_read():
    """What llm/parallel/ds_checkpoint.py and deepspeed.py read off DeepSpeed's ZeRO-1/2/3
    optimizers and parameters: flat partitions, ZeRO-3's bookkeeping, the gradient buffers
    the memory accounting reads (GRAD_BUFFERS: each on some stage), ZeRO-1/2's _hp_mapping."""
    from llm.parallel.deepspeed import GRAD_BUFFERS

    got = _deepspeed_probe()
    for kind, wanted in (("optimizer", DS_OPTIMIZER), ("param", DS_PARAM)):
        for attr, stages in wanted.items():
            assert all(attr in got[str(s)][kind] for s in stages), (kind, attr, got)
    for attr in GRAD_BUFFERS:
        assert any(attr in got[s]["optimizer"] for s in got), (attr, got)
    assert got["1"]["hp_mapping"] and got["2"]["hp_mapping"]


# ---- the scan itself -------------------------------------------------------------------------
PLANTED = '''
"""torch._in_a_docstring is no use."""
import torch
from torch.utils._pytree import tree_map

WRAPPERS = ("_planted_key",)


class Mine(torch.nn.Module):
    _planted_flag = True  # read by torch, never by us

    def __init__(self):
        super().__init__()
        self._cache = {}

    def _helper(self):
        return self._cache

    def _planted_hook(self):  # called by torch, never by us
        return None

    def forward(self, x):
        return self._helper() or self._buffers


class Hooked(torch._planted.Base):
    def hook(self):  # called by its private base, never by us
        return None


def _ours(t):
    # torch._comment_only and t._commented_attr are named in a comment only
    torch.planted_patch = _ours
    t.__class__ = Mine
    return t._planted_attr, torch._planted_op(1, out=t), getattr(torch.ops.aten, "_planted")
'''


def test_the_scan_finds_planted_private_names_and_not_ours_or_comments(tmp_path):
    path = tmp_path / "llm" / "planted.py"
    path.parent.mkdir()
    path.write_text(PLANTED)
    found = scan([path], root=tmp_path)
    assert set(found) == {
        "torch.utils._pytree.tree_map",
        "'_planted_key'",
        "torch.nn.Module._planted_flag",
        "torch.nn.Module._planted_hook",
        "torch.nn.Module._buffers",
        "torch._planted.Base",
        "torch._planted.Base.hook",
        "torch.planted_patch =",
        "*.__class__ = Mine",
        "*._planted_attr",
        "torch._planted_op",
        "torch._planted_op(out=)",
        "torch.ops.aten._planted",
    }
    line = next(i for i, s in enumerate(PLANTED.splitlines(), 1) if "_planted_op(" in s)
    assert found["torch._planted_op"] == [f"llm/planted.py:{line}"]


# ---- torch 2.11: the op_sac path only it runs ----------------------------------------------
PYTHON_211 = REPO / ".cache" / "venv211" / "bin" / "python"
PATH_211 = (
    "import json, torch, llm.recompute.op_sac as o; print(json.dumps([torch.__version__, "
    "o.POLICY_SEES_OUTPUT, [c.__name__ for c in o._HandOverCached.__mro__[1:2]]]))"
)
OP_SAC_TESTS = [
    "tests/test_recompute.py",
    "tests/test_activation_formula.py",
    "tests/test_recompute_strategies.py",
]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_op_sac_runs_its_torch_2_11_path_there():
    """torch 2.11 calls the SAC policy before each op, without its output, so op_sac swaps the
    forward's caching mode for ``_HandOverCached``, a subclass of the private
    ``_CachingTorchDispatchMode`` reading its ``storage``: code only torch 2.11 runs. `make
    venv211` installs torch 2.11 from PyPI into .cache/venv211 (the first time: minutes and
    about 5 GB); the op_sac tests of three files then run there."""
    made = subprocess.run(
        ["make", "-s", "venv211"], cwd=REPO, capture_output=True, text=True, timeout=1200
    )
    assert made.returncode == 0, (
        "torch 2.11 could not be installed into .cache/venv211 (`make venv211`):\n"
        + (made.stdout + made.stderr)[-4000:]
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    path = subprocess.run(
        [PYTHON_211, "-c", PATH_211], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert path.returncode == 0, path.stderr[-4000:]
    version, sees_output, base = json.loads(path.stdout)
    assert version.startswith("2.11.") and not sees_output, (version, sees_output)
    assert base == ["_CachingTorchDispatchMode"]
    tests = subprocess.run(
        [PYTHON_211, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
         "-k", "op_sac", *OP_SAC_TESTS],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert tests.returncode == 0, f"op_sac under torch {version}:\n{tests.stdout[-6000:]}"
