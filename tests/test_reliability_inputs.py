"""Inputs a run must read the same way every time: a distillation teacher is known by its files' contents, not their
folder (a copy resumes, other weights are refused); a token cache reused says again what its build warned of (bytes
that were not UTF-8); `lora.quant_backend` without `lora.quantize=nf4` is refused (docs/errors.md row 238); under
bare torchrun a refusal is the failure report's root cause (docs/errors.md, "Under bare torchrun")."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_distill_training import save_teacher

from helpers import by_step, refusal, shardlm_cli, tiny, train_in_process
from shardlm import ShardlmError

# ---- the teacher's identity ------------------------------------------------------------------------------------


def teacher_key(name: str | Path) -> str:
    from shardlm.objectives.distill.teacher import identity_key, teacher_identity, teacher_source

    return identity_key(teacher_identity(teacher_source(str(name))))


def test_a_teachers_identity_is_its_files_not_their_folder(tmp_path):
    """A model folder: the same config.json and weights in another folder are the same teacher; other weights or
    another config are not. A checkpoint alike. A hub name keeps its name in its identity."""
    from shardlm.objectives.distill.teacher import TeacherSource, identity_key, teacher_identity

    teacher = save_teacher(tmp_path / "teacher", seed=0)
    copy = shutil.copytree(teacher, tmp_path / "elsewhere" / "copy")
    assert teacher_key(copy) == teacher_key(teacher)
    assert str(tmp_path) not in json.dumps(teacher_identity(TeacherSource(str(copy), model_name=str(copy))))
    assert teacher_key(save_teacher(tmp_path / "other", seed=1)) != teacher_key(teacher)  # other weights
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert teacher_key(copy) != teacher_key(teacher)  # another config

    ckpt = tmp_path / "run" / "checkpoints" / "step_000000002"  # a checkpoint's files, hashed as they are
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(b"weights")
    (ckpt / "manifest.json").write_text("{}")
    moved = shutil.copytree(ckpt, tmp_path / "moved" / "step_000000002")

    def key(folder: Path) -> str:
        return identity_key(teacher_identity(TeacherSource(str(folder), checkpoint=folder)))

    assert key(moved) == key(ckpt)
    (moved / "__0_0.distcp").write_bytes(b"weightz")
    assert key(moved) != key(ckpt)
    hub = teacher_identity(TeacherSource("nobody/no-such-teacher", model_name="nobody/no-such-teacher"))
    assert hub["name"] == "nobody/no-such-teacher"


def test_a_copied_teacher_resumes_the_run_and_another_is_refused(corpus, cache_dir, tmp_path):
    """The run trained with TEACHER resumes with a byte-identical copy of it in another folder (it was refused as
    'other weights or config'), and still refuses a teacher with other weights."""
    teacher = save_teacher(tmp_path / "teacher", seed=0)
    run = tmp_path / "run"
    args = tiny(corpus, cache_dir, run, **{"train.objective": "distill", "distill.teacher": teacher,
                                           "train.max_steps": 2, "checkpoint.every": 2, "train.batch_size": 4})
    train_in_process(args)
    copy = shutil.copytree(teacher, tmp_path / "elsewhere" / "teacher")
    shutil.rmtree(teacher)
    train_in_process([*args, "train.max_steps=3", f"distill.teacher={copy}"])
    assert list(by_step(run)) == [1, 2, 3]
    other = save_teacher(tmp_path / "other", seed=1)
    with pytest.raises(ShardlmError, match="is not the teacher this run trained with"):
        train_in_process([*args, "train.max_steps=4", f"distill.teacher={other}"])


# ---- a reused cache's warnings ---------------------------------------------------------------------------------


def test_a_reused_cache_says_its_sources_utf8_warning_again(tmp_path, capsys):
    """The build warns (stderr) that bytes were replaced and keeps the warning in meta.json; each later run that
    reuses the cache says it once through its log (it was silent: the source is not read again)."""
    from shardlm.data.cache import build_cache
    from shardlm.data.sources import resolve
    from shardlm.tokenizer import byte_tokenizer

    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello \xff\xfe world\n" * 50)
    tok, root = byte_tokenizer(), tmp_path / "cache"
    warning = f"warning: {path}: 100 bytes are not valid UTF-8 and were replaced by U+FFFD"
    built: list[str] = []
    folder = build_cache(resolve(str(path)), tok, root, log=built.append)
    assert capsys.readouterr().err.strip() == warning and warning not in built
    assert json.loads((folder / "meta.json").read_text())["warnings"] == [warning]
    for _ in range(2):  # each run that reuses it
        reused: list[str] = []
        assert build_cache(resolve(str(path)), tok, root, log=reused.append) == folder
        assert reused == [warning] and capsys.readouterr().err == ""
    clean = tmp_path / "clean.txt"
    clean.write_text("hello world\n" * 50)
    for _ in range(2):  # a clean source: nothing kept, nothing said
        said: list[str] = []
        folder = build_cache(resolve(str(clean)), tok, root, log=said.append)
        assert not any(s.startswith("warning") for s in said)
    assert "warnings" not in json.loads((folder / "meta.json").read_text())


# ---- lora.quant_backend without lora.quantize -------------------------------------------------------------------


def test_a_quant_backend_without_quantize_is_refused(corpus, cache_dir, tmp_path):  # row 238
    from shardlm.config import LoraConfig
    from shardlm.models import lora

    lora.check(LoraConfig())  # the default config: auto, no quantization
    lora.check(LoraConfig(r=4))
    for chosen in ("torchao", "bitsandbytes"):
        with pytest.raises(ShardlmError) as e:
            lora.check(LoraConfig(r=4, quant_backend=chosen))
        assert str(e.value) == (f"lora.quant_backend={chosen} has no effect without lora.quantize=nf4: set "
                                "lora.quantize=nf4, or drop lora.quant_backend.")
    line = refusal(["train", *tiny(corpus, cache_dir, tmp_path / "run"), "lora.quant_backend=torchao", "--dry-run"])
    assert line.startswith("lora.quant_backend=torchao has no effect without lora.quantize=nf4") and "\n" not in line
    assert not (tmp_path / "run").exists()


# ---- a refusal under bare torchrun -----------------------------------------------------------------------------


def root_cause(report: str) -> str:
    """The `traceback :` line of the root cause in torchrun's failure report."""
    section = report.split("Root Cause (first observed failure):", 1)[1]
    found = re.search(r"^  traceback : (.*)$", section, re.M)
    assert found is not None, report
    return found.group(1)


def test_bare_torchrun_names_the_refusal_as_the_root_cause(tmp_path):
    """`torchrun --nproc-per-node 2 -m shardlm train` with an unknown key: rank 0 prints the one line, and
    torchrun's report (exit 1) gives that line as the root cause, read from the rank's error file (it said
    'To enable traceback see: ...')."""
    line = "error: unknown config key 'train.batchsize' in the command line. Did you mean 'train.batch_size'?"
    proc = shardlm_cli(["train", "train.batchsize=3", f"out_dir={tmp_path / 'run'}"], nproc=2, check=False,
                       timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 1, report
    assert line in report.splitlines(), report  # the rank's own line
    assert root_cause(report) == line
    assert "To enable traceback" not in report


def test_a_failure_is_recorded_for_torchrun_as_record_would(tmp_path, monkeypatch):
    """The error file torchrun reads back: a shardlm error's one line; any other exception with its traceback;
    nothing on success, on Ctrl-C, or without torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardlm.distributed.process_group import record_failure

    path = tmp_path / "error.json"
    record_failure(2)  # no torchrun, no exception
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_failure(0)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        record_failure(130)
    assert not path.exists()
    try:
        raise ShardlmError("data path 'x' does not exist.")
    except ShardlmError:
        record_failure(2)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))
    assert root_cause(ChildFailedError("shardlm", {0: failure}).format_msg()) == \
        "error: data path 'x' does not exist."
    try:
        raise ValueError("a bug")
    except ValueError:
        record_failure(1)
    message = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path)).message
    assert isinstance(message, dict) and message["message"] == "ValueError: a bug"
    assert "Traceback" in message["extraInfo"]["py_callstack"] and "a bug" in message["extraInfo"]["py_callstack"]
