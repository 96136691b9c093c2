"""The sections of the pass, by part, with the time each may take on one H100 or H200.

Each limit covers the section's process whole (imports, compiles, autotuning, warm-up);
the sections that sweep (attention) also stop adding rows at a budget of their own below
it and say which rows they left out. Part 1 sums to 15 minutes at most, part 2 to 13. The
limits come from the first GPU calls (H200, 2026-11-26): the model step's four rows took
113 s and the whole attention sweep 219 s; the CUDA tests need about 9 minutes (each 16-bit
Triton test autotunes its own shape, about 40 s), more than their limit, so a second call
with ``--resume`` finishes them without rerunning those that passed.

``data`` names (as globs) the repository files a section reads besides the modules its
process imports: the estimator composes conf/'s yaml; the CUDA tests run pytest in a process
of their own, over the tests, the package they test and its configuration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    name: str
    part: int
    limit_s: int  # on the GPU; the dry run has its own, smaller limit
    module: str  # its run(dry) -> Result, started by benchmarks.gpu_pass.section
    data: tuple[str, ...] = ()  # globs of the files it reads beside its imports


CONF = ("conf/**/*.yaml",)
PYTEST = ("tests/**/*.py", "llm/**/*.py", "train.py", "pyproject.toml", *CONF)
SECTIONS = [
    Section("speed", 1, 240, "benchmarks.gpu_pass.speed", ("llm/attention/choices.json",)),
    Section("model_step", 1, 150, "benchmarks.gpu_pass.model_step"),
    Section("nccl", 1, 150, "benchmarks.gpu_pass.nccl", CONF),
    Section("attention", 1, 270, "benchmarks.gpu_pass.attention"),
    Section("calibrate", 1, 90, "benchmarks.gpu_pass.calibrate"),
    Section("gpu_tests", 2, 200, "benchmarks.gpu_pass.gpu_tests", PYTEST),
    Section("estimator", 2, 90, "benchmarks.gpu_pass.estimator", CONF),
    Section("rehearse", 2, 120, "benchmarks.gpu_pass.rehearse", CONF),
    Section("recompute", 2, 45, "benchmarks.gpu_pass.recompute"),
    Section("optimizers", 2, 45, "benchmarks.gpu_pass.optimizers"),
    Section("fp8", 2, 130, "benchmarks.gpu_pass.fp8"),
    Section("fp8_gemm", 2, 60, "benchmarks.gpu_pass.fp8_gemm"),
    Section("inference", 2, 120, "benchmarks.gpu_pass.inference"),
    Section("quantization", 2, 90, "benchmarks.gpu_pass.quantization"),
]
DRY_LIMIT_S = 120
BY_NAME = {s.name: s for s in SECTIONS}


def selected(part: str, only: str | None) -> list[Section]:
    """The sections of ``part`` (1, 2 or all), or those named in ``only`` (a comma list)."""
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise SystemExit(
                f"--only {','.join(unknown)}: unknown section; choose from {', '.join(BY_NAME)}"
            )
        return [BY_NAME[n] for n in names]
    if part == "all":
        return list(SECTIONS)
    return [s for s in SECTIONS if s.part == int(part)]
