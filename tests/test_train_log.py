"""The run directory's train.log holds what the run showed at the console, each line
prefixed with the rank that wrote it (docs/design.md, note 47): a short run, its resume, a
config refused there, and spawned ranks' lines. The console itself keeps its plain lines."""

from __future__ import annotations

from pathlib import Path

from helpers import compose_config, small_run_overrides


def _command(train, args: list[str]) -> int:
    """``python train.py ARGS``: a command of its own, not a job of the one before."""
    train.JOBS.clear()
    return train.cli(args)


def _lines_of(path: Path, start: int = 0) -> list[str]:
    return path.read_text().splitlines()[start:]


def test_a_run_its_resume_and_a_refusal_land_in_train_log(
    train, capsys, tmp_path, text_corpus, cache_dir
):
    out = tmp_path / "run"
    args = [a for a in small_run_overrides(out, text_corpus, cache_dir) if "output_dir=" not in a]
    args.append(f"hydra.run.dir={out}")
    log = out / "train.log"

    assert _command(train, [*args, "train.max_steps=4"]) == 0
    first = _lines_of(log)
    said = "\n".join(first)
    for line in (
        "[rank 0][llm.console][INFO] - estimate per rank: ",
        "[rank 0][llm.console][INFO] - step      4/4  loss ",
        f"[rank 0][llm.console][INFO] - saved checkpoint {out / 'checkpoints' / 'step_000004'}",
        "[rank 0][llm.console][INFO] - done: 4 steps; final train loss ",
        f"[rank 0][llm.console][INFO] -   summary: {out / 'summary.json'}",
    ):
        assert line in said, line
    # The console keeps its lines as they were: plain, unprefixed.
    err = capsys.readouterr().err.splitlines()
    assert f"saved checkpoint {out / 'checkpoints' / 'step_000004'}" in err
    assert not any("[rank 0]" in line for line in err)

    assert _command(train, [*args, "train.max_steps=6"]) == 0
    resumed = "\n".join(_lines_of(log, len(first)))
    assert (
        f"[rank 0][llm.console][INFO] - resumed from {out / 'checkpoints' / 'step_000004'} "
        "at step 4" in resumed
    )
    assert "saved checkpoint" in resumed and "done: 6 steps" in resumed
    before = len(_lines_of(log))

    assert _command(train, [*args, "data.seq_len=100000"]) == 1
    (refusal,) = _lines_of(log, before)
    assert "[rank 0][llm.console][ERROR] - error: data.seq_len=100000 exceeds" in refusal
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: data.seq_len=100000")


def test_spawned_ranks_append_their_lines_under_their_rank(tmp_path, capfd):
    import log_ranks

    from llm.launch.launcher import _spawn

    cfg = compose_config([f"output_dir={tmp_path}", "parallelism=ddp", "launcher.nproc_per_node=2"])
    _spawn(cfg, 2, log_ranks.logs_a_line_per_rank)
    said = (tmp_path / "train.log").read_text()
    assert "[rank 0][llm.stand_in][WARNING] - rank 0's warning" in said
    assert "[rank 1][llm.stand_in][WARNING] - rank 1's warning" in said
    assert "[rank 0][llm.console][INFO] - rank 0's console line" in said
    # On the console, as logging's last resort printed a spawned rank's warnings before.
    err = capfd.readouterr().err.splitlines()
    assert {"rank 0's warning", "rank 1's warning", "rank 0's console line"} <= set(err)
