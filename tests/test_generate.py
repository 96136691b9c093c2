"""`python -m llm.generate`: sampling from a run's checkpoint, what generate.json holds, and
the bad inputs it refuses in one line (before any model is built where it can)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import compose_config
from helpers import run as train

from llm.config import GenerateConfig
from llm.data import TOKENIZER_FILE
from llm.errors import CheckpointError, ConfigError
from llm.inference.cli import run
from llm.inference.generate import generate
from llm.inference.load import load_for_inference
from llm.inference.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, text_corpus, cache_dir):
    """A short run with the default tokenizer kind (a BPE trained on the corpus), saving a
    checkpoint at steps 3 and 6."""
    tmp = tmp_path_factory.mktemp("gen")
    _, out = train(
        tmp,
        "bpe",
        text_corpus,
        cache_dir,
        "data.tokenizer=bpe",
        "data.vocab_size=320",
        "model.vocab_size=320",
        "checkpoint.every=3",
    )
    return out


def _gen(run_dir: Path | None, **kw) -> GenerateConfig:
    fields = {"run_dir": run_dir and str(run_dir), "prompt": "def ", "max_new_tokens": 6}
    return GenerateConfig(**(fields | {"temperature": 0} | kw))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_cli_writes_generate_json(bpe_run, tmp_path):
    out = tmp_path / "gen"
    env = dict(os.environ, WANDB_MODE="disabled")
    cmd = [
        sys.executable, "-m", "llm.generate", f"generate.run_dir={bpe_run}",
        "generate.prompt=import", "generate.max_new_tokens=5", "generate.temperature=0",
        f"output_dir={out}", "logger=none",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "generate.json").read_text())
    assert result["source"].endswith("step_000006") and result["step"] == 6
    assert len(result["tokens"]) == 1 and 1 <= len(result["tokens"][0]) <= 5
    assert set(result["tokens_per_s"]) == {"prefill", "decode"}
    assert result["tokens_per_s"]["prefill"] > 0
    kv = result["kv_cache_bytes"]
    # gpt2-tiny: 2 layers x 4 heads x 16 dims, fp32 on CPU; K and V.
    assert kv["per_token"] == 2 * 2 * 4 * 16 * 4
    assert kv["allocated"] >= kv["peak_used"] > 0
    assert result["paged"] is True and result["kernel"] == "gather"


def test_same_tokens_paged_and_contiguous_with_sampling(bpe_run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\nclass A:\ndef f(x):\n")
    sampled = dict(prompts_file=str(prompts), prompt=None, temperature=0.9, top_k=20, top_p=0.9)
    paged = run(_gen(bpe_run, **sampled, seed=3, block_size=4, cache_tokens=24), tmp_path / "a")
    whole = run(_gen(bpe_run, **sampled, seed=3, paged=False), tmp_path / "b")
    other_seed = run(_gen(bpe_run, **sampled, seed=4, paged=False), tmp_path / "c")
    assert len(paged["tokens"]) == 3  # the blank line is not a prompt
    assert paged["tokens"] == whole["tokens"]
    assert paged["preemptions"] > 0  # 24 tokens of cache cannot hold 3 growing sequences
    assert other_seed["tokens"] != whole["tokens"]


def test_top_k_1_is_greedy_and_eos_stops(bpe_run):
    loaded = load_for_inference(str(bpe_run), None, torch.device("cpu"))
    prompt = [loaded.tokenizer.encode("def f(")]
    greedy = generate(loaded.model, prompt, 8, SamplingParams(temperature=0), None).tokens[0]
    top1 = generate(loaded.model, prompt, 8, SamplingParams(temperature=5.0, top_k=1), None)
    assert top1.tokens[0] == greedy
    # Generation ends at end-of-text, which it keeps: name the last greedy token eos.
    assert len(greedy) == 8
    stopped = generate(loaded.model, prompt, 8, SamplingParams(temperature=0), greedy[-1])
    assert stopped.tokens[0] == greedy[: greedy.index(greedy[-1]) + 1]


def test_newest_corrupt_checkpoint_is_skipped(bpe_run, tmp_path, capsys):
    """Skipped, and said so with its problem, as training's resume says it."""
    copy = tmp_path / "run"
    shutil.copytree(bpe_run, copy)
    data = max((copy / "checkpoints/step_000006").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data_bytes = data.read_bytes()
    data.write_bytes(data_bytes[:100])
    capsys.readouterr()
    assert run(_gen(copy), tmp_path / "g")["step"] == 3
    said = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert said == [
        f"skipped checkpoint {copy}/checkpoints/step_000006: it is corrupt ({data.name} has "
        f"100 bytes, {len(data_bytes)} were written); trying the one before it"
    ]
    data3 = max((copy / "checkpoints/step_000003").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data3.write_bytes(data3.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        run(_gen(copy), tmp_path / "g")
    assert "verifies" in _one_line(err)
    with pytest.raises(CheckpointError) as err:
        run(_gen(None, checkpoint=str(copy / "checkpoints/step_000006")), tmp_path / "g")
    assert "unusable" in _one_line(err)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"run_dir": "/no/such/run"}, "does not exist"),
        ({"run_dir": None}, "exactly one of generate.run_dir"),
        ({"prompt": None}, "exactly one of generate.prompt"),
        ({"prompt": None, "prompts_file": "/no/such/file"}, "does not exist"),
        ({"prompt": "x" * 2000}, "max_seq_len"),
        ({"tokenizer": "byte"}, "not the tokenizer"),
        ({"paged": False, "cache_tokens": 3}, "less than one sequence"),
    ],
    ids=[
        "missing-run",
        "no-source",
        "no-prompt",
        "missing-prompts",
        "too-long",
        "tokenizer",
        "cache",
    ],
)
def test_bad_input_is_refused_in_one_line(bpe_run, tmp_path, fields, words):
    with pytest.raises(ConfigError) as err:
        run(_gen(**({"run_dir": bpe_run} | fields)), tmp_path / "g")
    assert words in _one_line(err)


def test_run_without_checkpoints_or_tokenizer(bpe_run, tmp_path):
    with pytest.raises(CheckpointError) as err:
        run(_gen(tmp_path), tmp_path / "g")
    assert "holds no checkpoint" in _one_line(err)
    copy = tmp_path / "run"
    shutil.copytree(bpe_run, copy)
    (copy / TOKENIZER_FILE).unlink()
    with pytest.raises(ConfigError) as err:
        run(_gen(copy), tmp_path / "g")
    assert "generate.tokenizer=PATH" in _one_line(err)
    # The same tokenizer given by path is accepted: its digest matches the checkpoint's.
    assert run(_gen(copy, tokenizer=str(bpe_run / TOKENIZER_FILE)), tmp_path / "g")["tokens"]


def test_generate_config_refusals():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"kernel": "cuda"}, {"block_size": 0}):
        with pytest.raises(ConfigError):
            GenerateConfig(**bad)


def _hf_folder(bpe_run: Path, folder: Path) -> Path:
    """A random GPT-2 of the run's vocabulary, saved with the run's tokenizer as transformers
    saves both."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    cfg = GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(bpe_run / TOKENIZER_FILE), eos_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(folder)
    return folder


def readme_generate_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["python", "-m", "llm.generate"]:
                commands.append(words[3:])
    return commands


def test_readme_generate_commands_run(bpe_run, tmp_path, monkeypatch):
    """Each README command composed by Hydra as the CLI composes it (its quoting included)
    and run in-process; test_cli_writes_generate_json runs the module itself."""
    commands = readme_generate_commands()
    assert len(commands) >= 3
    hf = _hf_folder(bpe_run, tmp_path / "hf")
    (tmp_path / "prompts.txt").write_text("import os\nclass A:\n")
    monkeypatch.chdir(tmp_path)  # the README's relative prompts.txt
    for i, args in enumerate(commands):
        args = [
            a.replace("outputs/DATE/TIME", str(bpe_run)).replace(
                "path/to/hf-gpt2-or-llama", str(hf)
            )
            for a in args
        ]
        out = tmp_path / f"out{i}"
        cfg = compose_config([*args, "generate.max_new_tokens=4", f"output_dir={out}"])
        result = run(cfg.generate, out)
        assert json.loads((out / "generate.json").read_text())["tokens"] == result["tokens"]
        assert all(1 <= len(t) <= 4 for t in result["tokens"]), shlex.join(args)


def test_a_full_disk_saving_the_tokenizer_is_one_line(bpe_run, tmp_path, monkeypatch):
    import errno

    from llm.data import load_tokenizer, save_tokenizer
    from llm.errors import DiskFullError

    tokenizer = load_tokenizer(str(bpe_run / TOKENIZER_FILE))
    save_tokenizer(tokenizer, tmp_path / "ok")
    assert load_tokenizer(str(tmp_path / "ok" / TOKENIZER_FILE)).digest == tokenizer.digest

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError) as err:
        save_tokenizer(tokenizer, tmp_path / "full")
    assert "no space left" in str(err.value) and "\n" not in str(err.value)
    assert not list((tmp_path / "full").iterdir())  # no partial file left behind
