"""The GPU pass's calibrate section and the device profiles it writes for the plan's time
model (``estimate.device=NAME``): the dry run writes a profile the estimator loads, a
profile reads back exactly at its measured points and monotone between them, a profile at
half the nominal rate doubles the compute time, a GPU without a profile scales another's,
and an unknown device is refused in one line."""

from __future__ import annotations

import itertools
import sys

import pytest
from helpers import compose_config

from benchmarks.gpu_pass import calibrate
from benchmarks.gpu_pass.common import OUT_ENV
from llm.build import model_args_for
from llm.errors import ConfigError
from llm.estimate import device_profile
from llm.estimate.cluster import Cluster
from llm.estimate.device_profile import interpolate, load_profile, resolve
from llm.estimate.layout import Layout
from llm.estimate.plan import plan

ENV = {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "date": "2026-11-28"}
SPEC = calibrate.GPU


def _rows(matmul, attention) -> list[dict]:
    """Rows as the section writes them, TFLOP/s from ``matmul(t, h, r)`` and
    ``attention(backend, d, s)``."""
    rows = [
        {"measure": "matmul", "tokens": t, "width": h, "ratio": r, "tflops": matmul(t, h, r)}
        for t, h, r in itertools.product(SPEC["tokens"], SPEC["widths"], SPEC["ratios"])
    ]
    rows += [
        {"measure": f"attention:{b}", "head_dim": d, "seq": s, "tflops": attention(b, d, s)}
        for b, d, s in itertools.product(calibrate.BACKENDS, SPEC["head_dims"], SPEC["seq_lens"])
    ]
    return [*rows, {"measure": "adamw_fused", "gb_per_s": 2000.0}]


def _write(folder, matmul, attention=None, env=ENV):
    rows = _rows(matmul, attention or (lambda b, d, s: matmul(SPEC["tokens"][0], 768, 1)))
    prof = calibrate.profile(rows, env, SPEC, dry=False, record="a test's rows")
    return calibrate.write_profile(prof, folder)


def _rising(t, h, r):
    """TFLOP/s that grow with every axis, distinct at every point."""
    return 100 + t / 100 + h / 50 + 10 * r


@pytest.mark.slow
def test_the_dry_run_writes_a_profile_the_estimator_loads(tmp_path, monkeypatch):
    """The section on CPU at tiny sizes: rows, no goal missed, and cpu-dry.yaml under the
    pass's --out, which loads and gives back its matmul rows' figures at their shapes."""
    monkeypatch.setenv(OUT_ENV, str(tmp_path))
    result = calibrate.run(dry=True)
    assert all(g.met is not False for g in result.goals)
    path = tmp_path / "device" / "cpu-dry.yaml"
    prof = load_profile(path)
    matmuls = [r for r in result.rows if r["measure"] == "matmul"]
    assert len(matmuls) == len(calibrate.DRY["tokens"]) * 2 * 3
    for r in matmuls:
        got = prof.matmul_flops_per_s(r["tokens"], r["width"], r["width"] * r["ratio"])
        assert got == pytest.approx(r["tflops"] * 1e12, rel=1e-12)
    assert {r["measure"] for r in result.rows} >= {"adamw_fused", "add", "rms_norm"}


def test_a_profile_reads_back_exactly_at_its_points_and_monotone_between(tmp_path):
    prof = load_profile(_write(tmp_path, _rising))
    for t, h, r in itertools.product(SPEC["tokens"], SPEC["widths"], SPEC["ratios"]):
        assert prof.matmul_flops_per_s(t, h, h * r) == pytest.approx(_rising(t, h, r) * 1e12)
    # Between two measured token counts: strictly between them, rising, the log midpoint at
    # their mean.
    lo, hi = SPEC["tokens"][:2]
    sweep = [lo * (hi / lo) ** (i / 10) for i in range(11)]
    got = [prof.matmul_flops_per_s(t, 4096, 4096) for t in sweep]
    assert got == sorted(got) and len(set(got)) == len(got)
    assert got[5] == pytest.approx((_rising(lo, 4096, 1) + _rising(hi, 4096, 1)) / 2 * 1e12)
    # Beyond the grid the edge value holds.
    assert prof.matmul_flops_per_s(10**6, 16384, 65536) == pytest.approx(
        _rising(SPEC["tokens"][-1], 16384, 4) * 1e12
    )


def test_interpolation_between_two_points_is_monotone_on_every_axis():
    axes = [[1.0, 4.0], [2.0, 8.0]]
    grid = [[10.0, 30.0], [50.0, 20.0]]  # rising on one axis, falling on the other
    assert (
        interpolate(axes, grid, [1.0, 2.0]) == 10.0 and interpolate(axes, grid, [4.0, 8.0]) == 20.0
    )
    along = [interpolate(axes, grid, [4.0, 2.0 * 4 ** (i / 8)]) for i in range(9)]
    assert along == sorted(along, reverse=True)


def _cfg(*overrides):
    return compose_config(
        [
            "logger=none",
            "output_dir=unused",
            "model=gpt2-small",
            "model.vocab_size=50304",
            "data.seq_len=1024",
            "precision=bf16",
            "estimate.plan=true",
            "estimate.gpus_per_node=8",
            "estimate.global_batch=64",
            *overrides,
        ]
    )


def _step_times(*overrides) -> dict:
    cfg = _cfg(*overrides)
    rows = plan(cfg, model_args_for(cfg, vocab_size=50304))
    return {r.layout: r.step_time_s for r in rows}


def test_a_profile_at_half_the_nominal_rate_doubles_the_compute(tmp_path):
    """One GPU (no communication): every matmul and attention at 200 TFLOP/s against the
    nominal 400e12 doubles the step; a profile where larger micro-batches run faster makes
    the b = 8 layout cheaper per sequence than b = 1 where the nominal model makes them equal."""
    half = _write(tmp_path / "half", lambda t, h, r: 200.0)
    nominal = _step_times("estimate.gpus_per_node=1", "estimate.flops_per_s=400e12")
    profiled = _step_times("estimate.gpus_per_node=1", f"estimate.device={half}")
    assert nominal.keys() == profiled.keys() and nominal
    for layout, seconds in nominal.items():
        assert profiled[layout] == pytest.approx(2 * seconds, rel=1e-9), layout
    by_tokens = _write(tmp_path / "tokens", lambda t, h, r: 100.0 * t / 2048)
    shaped = _step_times("estimate.gpus_per_node=1", f"estimate.device={by_tokens}")
    small, large = (
        Layout(dp=1, micro_batch=b, microbatches=64 // b, zero_stage=0, recompute="none")
        for b in (1, 8)
    )
    assert nominal[small] == pytest.approx(nominal[large])
    assert shaped[large] < shaped[small]


def test_a_gpu_without_a_profile_scales_anothers_by_the_nominal_peaks(
    tmp_path, monkeypatch, capsys
):
    _write(tmp_path, lambda t, h, r: 600.0)  # h200.yaml
    h200, a100 = resolve("h200", tmp_path), resolve("a100", tmp_path)
    assert a100.scale == pytest.approx(312 / 989) and h200.scale == 1.0
    assert a100.matmul_flops_per_s(8192, 4096, 4096) == pytest.approx(600e12 * 312 / 989)
    assert "\n" not in a100.note and "h200" in a100.note and "312/989" in a100.note
    # python -m llm.estimate prints that line with the plan.
    monkeypatch.setattr(device_profile, "PROFILES", tmp_path)
    from llm.estimate.__main__ import main

    argv = ["llm.estimate", "logger=none", f"hydra.run.dir={tmp_path}/h", "model=gpt2-tiny",
            "data.seq_len=64", "estimate.plan=true", "estimate.gpus_per_node=2",
            "estimate.device=a100"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    main()
    assert a100.note in capsys.readouterr().out


def test_an_unknown_device_is_refused_in_one_line_naming_the_profiles(tmp_path):
    _write(tmp_path, lambda t, h, r: 600.0)
    with pytest.raises(ConfigError) as refused:
        resolve("b300", tmp_path)
    assert "\n" not in str(refused.value)
    assert "h200" in str(refused.value) and "a100" in str(refused.value)
    with pytest.raises(ConfigError, match=r"no device profile in .* to scale from"):
        resolve("a100", tmp_path / "empty")
    assert resolve("cuda", tmp_path) is None and resolve("cpu", tmp_path) is None


def test_an_incomplete_profile_is_refused(tmp_path):
    path = _write(tmp_path, lambda t, h, r: None if (t, h, r) == (2048, 768, 4) else 500.0)
    with pytest.raises(ConfigError, match="points missing"):
        load_profile(path)


def test_estimate_device_names_the_kernels_and_the_cluster_its_profile(tmp_path):
    """estimate.device=<a profile> sizes memory for CUDA kernels, as cuda does."""
    path = _write(tmp_path, lambda t, h, r: 500.0)
    cfg = _cfg(f"estimate.device={path}")
    assert cfg.estimate.kernels == "cuda" and _cfg("estimate.device=cpu").estimate.kernels == "cpu"
    assert Cluster.from_config(cfg).profile.source == str(path)
    assert Cluster.from_config(_cfg()).profile is None
