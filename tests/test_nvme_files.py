"""The NVMe tier's pieces without ranks: the files (direct or buffered I/O, a full disk as
one line), each rank's folder (removed at the end, a crashed run's cleared), the config's
spellings and refusals, the checks before any rank starts, DeepSpeed's nvme section, and
the estimator's and planner's nvme rows."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import compose_config

from llm.build import model_args_for, tokenizer_vocab_size
from llm.config import ParallelismConfig
from llm.errors import ConfigError, DiskFullError
from llm.estimate.estimator import estimate
from llm.estimate.plan import plan, plan_row
from llm.parallel.ds_config import build_ds_config
from llm.parallel.zero.nvme import RankFolder, check_nvme_path
from llm.parallel.zero.nvme.direct_file import ALIGN, DirectFile, aligned_buffer
from llm.precision import resolve_precision

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def _filled(nbytes: int, seed: int) -> memoryview:
    buf = aligned_buffer(nbytes)
    view = torch.frombuffer(buf, dtype=torch.uint8)
    view.copy_(torch.randint(0, 256, view.shape, generator=torch.Generator().manual_seed(seed)))
    return memoryview(buf)


@pytest.mark.parametrize("direct", [True, False])
def test_sections_round_trip_and_are_counted(tmp_path, monkeypatch, direct):
    if not direct:  # as on a file system that refuses O_DIRECT (tmpfs)
        monkeypatch.setattr(DirectFile, "_direct_works", staticmethod(lambda fd: False))
    f = DirectFile(tmp_path / "master.bin", 3 * ALIGN)
    assert f.direct is direct and os.path.getsize(f.path) == 3 * ALIGN  # reserved up front
    a, b = _filled(2 * ALIGN, 1), _filled(ALIGN, 2)
    f.write(a, 0)
    f.write(b, 2 * ALIGN)
    back = memoryview(aligned_buffer(3 * ALIGN))
    f.read(back, 0)
    assert bytes(back[: 2 * ALIGN]) == bytes(a) and bytes(back[2 * ALIGN :]) == bytes(b)
    assert (f.read_bytes, f.written_bytes) == (3 * ALIGN, 3 * ALIGN)
    f.close()


def test_a_full_disk_during_a_write_is_one_line(tmp_path, monkeypatch):
    f = DirectFile(tmp_path / "exp_avg.bin", ALIGN)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(DiskFullError) as err:
        f.write(_filled(ALIGN, 0), 0)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message
    assert "parallelism.nvme_path" in message


def test_a_file_size_limit_refuses_the_files_at_start(tmp_path):
    """A real kernel refusal, not a patched one: under RLIMIT_FSIZE (SIGXFSZ ignored, so
    the write fails with EFBIG instead of killing the process) reserving the file fails."""
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from llm.errors import DiskFullError\n"
        "from llm.parallel.zero.nvme.direct_file import DirectFile\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
        "try:\n"
        "    DirectFile(Path(sys.argv[1]) / 'master.bin', 1 << 20)\n"
        "except DiskFullError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"no space left on {tmp_path}")
    assert done.stdout.count("\n") == 1


def test_each_run_has_its_folder_and_a_crashed_runs_folder_goes(tmp_path):
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process has now (reuse within the test is not a concern)
    stale = tmp_path / f"llm-offload.{host}.{dead.pid}.abc"
    stale.mkdir()
    (stale / "master.bin").write_bytes(b"x" * 100)
    live = tmp_path / f"llm-offload.{host}.{os.getppid()}.def"  # pytest's parent: alive
    live.mkdir()
    folder = RankFolder(str(tmp_path))
    assert not stale.exists() and live.exists()
    assert folder.path.parent == tmp_path and folder.path.name.startswith(
        f"llm-offload.{host}.{os.getpid()}."
    )
    assert RankFolder(str(tmp_path)).path != folder.path  # a second run's folder is its own
    folder.remove()
    assert not folder.path.exists()


def test_offload_spellings_and_refusals():
    assert ParallelismConfig(name="zero2", offload_optimizer=True).offload_optimizer == "cpu"
    assert ParallelismConfig(name="zero2", offload_optimizer="True").offload_optimizer == "cpu"
    assert ParallelismConfig(name="zero2", offload_optimizer="false").offload_optimizer == "none"
    cases = {
        "needs parallelism.nvme_path": dict(name="zero1", offload_optimizer="nvme"),
        "stage 3 only": dict(name="zero2", offload_params="nvme", nvme_path="/tmp"),
        "is read only with": dict(name="zero2", nvme_path="/tmp"),
        "under stage 3 only": dict(name="deepspeed", zero_stage=2, offload_optimizer="nvme"),
        "choose one of none, cpu, nvme": dict(name="zero1", offload_optimizer="disk"),
    }
    for words, kwargs in cases.items():
        with pytest.raises(ConfigError, match=words) as err:
            ParallelismConfig(**kwargs)
        assert "\n" not in str(err.value)


def test_the_folder_is_checked_before_any_rank_starts(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="is not a folder"):
        check_nvme_path(str(tmp_path / "missing"), 1)
    if os.access("/sys", os.W_OK) and not _refuses_files("/sys"):
        pytest.skip("no folder here refuses files")
    with pytest.raises(ConfigError, match="takes no files"):
        check_nvme_path("/sys", 1)
    check_nvme_path(str(tmp_path), 1 << 20)
    monkeypatch.setattr("llm.parallel.zero.nvme.folder.free_bytes", lambda p: 1 << 20)
    with pytest.raises(DiskFullError, match="the offloaded states need 2 MB"):
        check_nvme_path(str(tmp_path), 2 << 20)


def _refuses_files(path: str) -> bool:
    try:
        (Path(path) / ".probe").touch()
    except OSError:
        return True
    (Path(path) / ".probe").unlink()
    return False


def _tiny_cpu_config(tmp_path, *overrides: str):
    """gpt2-tiny on CPU with the byte tokenizer and the optimizer offloaded to nvme."""
    return compose_config(
        [
            f"output_dir={tmp_path}/run",
            "model=gpt2-tiny",
            "train.device=cpu",
            "data.tokenizer=byte",
            "parallelism.offload_optimizer=nvme",
            *overrides,
        ]
    )


def test_validate_refuses_what_the_streamed_step_cannot_run(tmp_path):
    from llm.validate import validate

    def cfg(*extra):
        return _tiny_cpu_config(tmp_path, "parallelism=zero2", *extra)

    with pytest.raises(ConfigError, match="is not a folder"):
        validate(cfg(f"parallelism.nvme_path={tmp_path}/none"))
    with pytest.raises(ConfigError, match="element-wise optimizers"):
        validate(cfg(f"parallelism.nvme_path={tmp_path}", "optimizer=muon"))


def test_deepspeeds_nvme_offload_with_checkpoints_is_refused_before_start(tmp_path):
    """Our DeepSpeed checkpoints read its fp32 partitions in memory, which its NVMe swap
    leaves empty (every rank's first save failed mid-run): one line before start; without
    checkpoints the same run passes the checks."""
    from llm.validate import validate

    def cfg(*extra):
        return _tiny_cpu_config(
            tmp_path, "parallelism=deepspeed", "parallelism.zero_stage=3",
            f"parallelism.nvme_path={tmp_path}", *extra,
        )  # fmt: skip

    with pytest.raises(ConfigError, match=r"set checkpoint\.enabled=false") as err:
        validate(cfg())
    assert "\n" not in str(err.value)
    validate(cfg("checkpoint.enabled=false"))


def test_deepspeed_gets_its_nvme_sections():
    cfg = compose_config(
        [
            "output_dir=/tmp/unused",
            "parallelism=deepspeed",
            "parallelism.zero_stage=3",
            "parallelism.offload_optimizer=nvme",
            "parallelism.offload_params=nvme",
            "parallelism.nvme_path=/local_nvme",
        ]
    )
    zero = build_ds_config(cfg, 2, resolve_precision("fp32", CPU), False, d_model=64)[
        "zero_optimization"
    ]
    for section in ("offload_optimizer", "offload_param"):
        assert zero[section] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False}


@pytest.mark.parametrize("params", ["nvme", "none"])
def test_the_lean_nvme_ds_config_keeps_our_paths_and_sets_its_knobs(params):
    """examples/ds_config_nvme.json (benchmarks/nvme_offload.py's -lean rows): our tiers and
    folder fill its "auto"s; its memory knobs are DeepSpeed's to read."""
    example = Path(__file__).resolve().parents[1] / "examples" / "ds_config_nvme.json"
    cfg = compose_config(
        [
            "output_dir=/tmp/unused",
            "parallelism=deepspeed",
            "parallelism.zero_stage=3",
            "parallelism.offload_optimizer=nvme",
            f"parallelism.offload_params={params}",
            "parallelism.nvme_path=/local_nvme",
            f"parallelism.deepspeed_config={example}",
        ]
    )
    ds = build_ds_config(cfg, 2, resolve_precision("fp32", CPU), False, d_model=64)
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"] == {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "pin_memory": False,
    }
    assert zero["sub_group_size"] == 10**8
    assert zero["offload_param"].get("device") == ("nvme" if params == "nvme" else None)
    assert zero["offload_param"]["max_in_cpu"] == 0
    assert ds["optimizer"]["params"]["lr"] == cfg.optimizer.lr


def _estimate(*overrides):
    cfg = compose_config(
        [
            "logger=none",
            "output_dir=unused",
            "model=gpt2-tiny",
            "precision=bf16",
            "launcher.nproc_per_node=2",
            "estimate.device=cpu",
            *overrides,
        ]
    )
    return estimate(cfg, model_args_for(cfg, vocab_size=257))


def test_the_estimate_moves_nvme_states_to_files_and_keeps_the_pool():
    nvme = ("parallelism.nvme_path=/tmp",)
    memory = _estimate("parallelism=zero3")
    est = _estimate(
        "parallelism=zero3",
        "parallelism.offload_optimizer=nvme",
        "parallelism.offload_params=nvme",
        *nvme,
    )
    # bf16: the fp32 master and both moments (12 bytes per parameter of the rank's slice),
    # and the 16-bit shard, leave the device for the files.
    assert est.device["optimizer_states"] == est.device["params"] == 0
    assert est.disk["optimizer_states"] == memory.device["optimizer_states"]
    assert est.disk["params"] == memory.device["params"]
    # What stays in host memory is the pools: smaller than what they stream.
    assert 0 < est.host["optimizer_states"] < est.disk["optimizer_states"] * 3
    assert est.host["params"] > 0


@pytest.mark.parametrize("host_gb,tier", [(2048, "cpu"), (64, "nvme")])
def test_a_layout_that_fits_only_with_nvme_says_so(host_gb, tier):
    """llama3-8b on 8 GPUs of 12 GiB: nothing fits on the devices alone; with 2 TiB of host
    memory per node the ZeRO states fit there, with 64 GiB only NVMe holds them."""
    cfg = compose_config(
        [
            "logger=none",
            "output_dir=unused",
            "model=llama3-8b",
            "data.seq_len=8192",
            "estimate.gpus_per_node=8",
            "estimate.device_memory_gb=12",
            f"estimate.host_memory_gb={host_gb}",
        ]
    )
    rows = plan(cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))
    fitting = [r for r in rows if r.fits]
    assert fitting and {r.offload for r in fitting} == {tier}
    assert all(r.bytes_per_gpu <= 12 * 2**30 and r.layout.zero_stage > 0 for r in fitting)
    assert plan_row(fitting[0])["offload"] == tier


def test_deepspeeds_nvme_offload_names_what_it_lacks(monkeypatch):
    """Without libaio DeepSpeed's async_io op cannot build: one line before its engine
    starts, naming the command that installs it, not its RuntimeError from inside the
    swapper. The builder is made to find no libaio, which this machine may have."""
    op_builder = pytest.importorskip("deepspeed.ops.op_builder")

    class NoLibaio:
        def is_compatible(self, verbose: bool = False) -> bool:
            return False

    monkeypatch.setattr(op_builder, "AsyncIOBuilder", NoLibaio)
    from llm.parallel.deepspeed import _require_async_io

    with pytest.raises(ConfigError) as err:
        _require_async_io()
    message = str(err.value)
    assert "libaio's library and headers are missing" in message and "\n" not in message
    assert "`make libaio` (apt-get install libaio-dev)" in message


def test_the_plan_offers_no_offload_under_expert_parallelism():
    """The trainer refuses offload with ep > 1 (expert slices step on the device), so the
    plan never offers it there: Mixtral-8x7B on 2 x 8 GPUs of 80 GiB, where offload makes
    ep 1 layouts fit (and made 20 ep > 1 rows fit before the plan knew of the refusal)."""
    cfg = compose_config(
        [
            "logger=none",
            "output_dir=unused",
            "model=mixtral-8x7b",
            "data.seq_len=4096",
            "estimate.nodes=2",
            "estimate.gpus_per_node=8",
        ]
    )
    rows = plan(cfg, model_args_for(cfg, vocab_size=tokenizer_vocab_size(cfg)))
    assert {r.layout.ep for r in rows} == {1, 2, 4, 8}
    assert all(r.offload == "none" for r in rows if r.layout.ep > 1)
    assert any(r.fits and r.offload == "cpu" for r in rows if r.layout.ep == 1)
