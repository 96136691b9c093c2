"""Every private or deprecated symbol of torch, DeepSpeed and bitsandbytes the repo relies
on, touched in one place: an upgrade that removes or renames one fails here, by name,
instead of deep in a run. docs/design.md ("Private APIs we rely on") says why each is needed and where.
Each row: (what we use, where, how to reach it)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

TORCH = [
    # Our bounded checkpoint writer closes a file every checkpoint.file_mb.
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter._write_data"),
    # parallelism.replicate (HSDP-style replication with FSDP2's machinery).
    ("torch.distributed._composable.replicate_with_fsdp", "replicate"),
    # The FSDP2 collective interfaces our byte counter wraps.
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter"),
    # Pipeline sends counted per stage.
    ("torch.distributed.pipelining", "PipelineStage.get_fwd_send_ops"),
    ("torch.distributed.pipelining", "PipelineStage.get_bwd_send_ops"),
    # Callbacks at the end of backward (the peak tracker, DeepSpeed's gradient sampling).
    ("torch.autograd", "Variable._execution_engine"),
    # Reading only a rank's rows of a checkpoint (model.init_from).
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    # Recompute policies.
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl"),
    ("torch._functorch", "config"),
    # The live-storage ledger and the communication counter.
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass"),
    ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass_type"),
    ("torch.utils._pytree", "tree_leaves"),
    ("torch.ops", "_c10d_functional"),
    # Expert-parallel slices kept out of DDP's all-reduce (llm/parallel/ddp.py).
    ("torch.nn.parallel", "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model"),
    # MoE experts in one kernel (llm/models/moe.py, model.moe.kernel=grouped).
    ("torch", "_grouped_mm"),
    # INT4 weight-only matmuls of a quantised linear (llm/inference/quantize.py).
    ("torch", "_weight_int4pack_mm"),
    ("torch", "_convert_weight_to_int4pack"),
    ("torch", "_weight_int4pack_mm_for_cpu"),
    ("torch", "_convert_weight_to_int4pack_for_cpu"),
    # A fake process group: the inference estimate's tp shards, built without ranks (tests).
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    # The foreach kernels our optimizers step with.
    ("torch", "_foreach_lerp_"),
    ("torch", "_foreach_norm"),
]


def _reach(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "path"), TORCH, ids=[f"{m}.{p}" for m, p in TORCH])
def test_torch_private_symbol_exists(module, path):
    assert _reach(module, path) is not None


def test_the_bounded_writer_calls_write_data_as_filesystemwriter_does():
    """Our writer hands ``_write_data(planner, file_queue)`` a queue of its own files."""
    from torch.distributed.checkpoint import FileSystemWriter

    params = list(inspect.signature(FileSystemWriter._write_data).parameters)
    assert params == ["self", "planner", "file_queue"]


def test_execution_engine_queues_callbacks():
    assert callable(torch.autograd.Variable._execution_engine.queue_callback)


DEEPSPEED_SOURCE = [
    # Flat fp32 partitions our DeepSpeed checkpoints expose (llm/parallel/ds_checkpoint.py).
    (
        "deepspeed.runtime.zero.stage3",
        "DeepSpeedZeroOptimizer_Stage3",
        "fp32_partitioned_groups_flat",
    ),
    (
        "deepspeed.runtime.zero.stage3",
        "DeepSpeedZeroOptimizer_Stage3",
        "fp16_partitioned_groups_flat",
    ),
    # ZeRO-1/2's hp <-> lp fragment mapping on each parameter.
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "_hp_mapping"),
    # Gradient buffers the memory accounting reads (llm/parallel/deepspeed.py GRAD_BUFFERS).
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "averaged_gradients"),
]


@pytest.mark.parametrize(
    ("module", "cls", "attr"), DEEPSPEED_SOURCE, ids=[f"{c}.{a}" for _, c, a in DEEPSPEED_SOURCE]
)
def test_deepspeed_internal_attribute_is_still_set(module, cls, attr):
    """Set on instances only: the class's source (or its module's) must still assign it."""
    deepspeed_module = pytest.importorskip(module)
    source = inspect.getsource(deepspeed_module)
    assert hasattr(deepspeed_module, cls) and attr in source


def test_deepspeed_private_functions_exist():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    assert callable(groups._release_process_group_references)
    assert callable(DeepSpeedEngine._get_optimizer_loss_scale)


def test_bitsandbytes_internals_our_sharded_adamw8bit_relies_on():
    """llm/optim/adamw8bit.py overrides get_config, init_state and update_step (the size
    rule from the whole tensor; DTensors stepped on their local shards) and
    llm/parallel/zero/state.py nests the quantisation state under bitsandbytes' own key."""
    import bitsandbytes as bnb

    cls = bnb.optim.optimizer.Optimizer8bit
    assert cls._FSDP_WRAPPED_QUANT_STATE_KEY == "__bnb_optimizer_quant_state__"
    for name in ("get_config", "init_state", "update_step"):
        assert callable(getattr(cls, name)), name
    assert list(inspect.signature(cls.init_state).parameters) == [
        "self",
        "group",
        "p",
        "gindex",
        "pindex",
    ]
    opt = bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(4))])
    assert {
        "state1",
        "state2",
        "absmax1",
        "absmax2",
        "qmap1",
        "qmap2",
    } <= opt.non_castable_tensor_keys
