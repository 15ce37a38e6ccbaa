"""Distillation's bad input (docs/errors.md rows 210-220): `shardlm train` and `--dry-run` refuse it with the same
one line, and leave no run folder behind; `shardlm estimate` counts the teacher and the loss's chunks of both
models within 15% of a distillation step's measured peak."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_distill_training import save_teacher

from helpers import GPT2_VOCAB, folder_digest, refusal, tiny


@pytest.fixture(scope="module")
def folder(tmp_path_factory, corpus) -> Path:
    root = tmp_path_factory.mktemp("distill_errors")
    save_teacher(root / "teacher", seed=0)
    save_teacher(root / "chatml_teacher", seed=0, chatml=True)  # two more tokens: another token -> id map
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "a", "rejected": "b"}) + "\n"
                                              for i in range(40)))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}"}) + "\n" for i in range(40)))
    (root / "corpus.txt").write_text(corpus.read_text())
    return root


def args(folder: Path, *overrides: str) -> list[str]:
    return ["train", *tiny(folder / "corpus.txt", folder / "cache", folder / "run", **{
        "train.objective": "distill", "distill.teacher": folder / "teacher", "train.max_steps": 2}),
        *(o.replace("DIR/", f"{folder}/") for o in overrides)]


def refused_alike(folder: Path, overrides: list[str], message: str) -> None:
    """The dry run and the run refuse with the same one line; neither leaves the run folder (nor the dry run a
    cache)."""
    before = sorted(p.name for p in folder.iterdir())
    dry = refusal([*args(folder, *overrides), "--dry-run"])
    assert re.search(message, dry) and "\n" not in dry, dry
    assert sorted(p.name for p in folder.iterdir()) == before
    assert refusal(args(folder, *overrides)) == dry
    assert not (folder / "run").exists()


def test_the_loss_settings_out_of_range_are_refused(folder):  # rows 213-216, 220
    for overrides, message in [
        (["distill.beta=1.5"], r"^distill.beta must be in \[0, 1\] \(0 = forward KL.*got 1.5.$"),
        (["distill.alpha=-0.1"], r"^distill.alpha must be in \[0, 1\] \(1 = distillation alone.*got -0.1.$"),
        (["distill.on_policy=2"], r"^distill.on_policy must be in \[0, 1\] .*got 2.0.$"),
        (["distill.temperature=0"], r"^distill.temperature must be > 0 .*got 0.0.$"),
        (["distill.teacher_topk=-1"], r"^distill.teacher_topk must be >= 0 .*got -1.$"),
        (["distill.on_policy=0.5", "distill.teacher_topk=4"], r"^distill.teacher_topk=4 stores the teacher's scores "
                                                              r"of the data once, and cannot cover the completions"),
        (["distill.on_policy=0.5"], r"^distill.max_new_tokens=128 leaves no room for a prompt in data.seq_len=32"),
    ]:
        refused_alike(folder, overrides, message)


def test_a_teacher_missing_not_loading_or_of_other_tokens_is_refused(folder):  # rows 210-212
    for overrides, message in [
        (["distill.teacher=null"], "^train.objective=distill needs a teacher: set distill.teacher to"),
        (["distill.teacher=DIR/nowhere"], "^distill.teacher '.*nowhere' is a path that does not exist. Give an HF "
                                          "model folder, a hub name"),
        (["distill.teacher=DIR/cache"], "^distill.teacher '.*cache' is no model: "),
        (["distill.teacher=DIR/chatml_teacher"], "^distill.teacher '.*chatml_teacher' does not share the student's "
                                                 "tokenizer \\(.*\\): its scores would be of other tokens. Distill "
                                                 "from a teacher with the student's tokenizer"),
    ]:
        (folder / "cache").mkdir(exist_ok=True)
        refused_alike(folder, overrides, message)


def test_data_distillation_cannot_train_on_is_refused(folder):  # rows 217-218
    for overrides, message in [
        (["distill.on_policy=0.5", "distill.max_new_tokens=8"],
         r"^distill.on_policy=0.5 samples the student's answers to the examples' prompts, and data.train was read "
         r"as text blocks, which have none: give examples"),
        (["data.train=DIR/pairs.jsonl"], "^the data holds preference pairs .*which train.objective=distill does not "
                                         "train on"),
        (["data.train=DIR/prompts.jsonl"], "prompts.jsonl:1: .*'completion' is missing"),
    ]:
        refused_alike(folder, overrides, message)


def test_the_dry_run_shows_the_teacher_and_the_loss(folder):
    from shardlm.config import load_config
    from shardlm.preflight.dryrun import dry_run

    out = dry_run(load_config(None, args(folder, "distill.beta=0", "distill.alpha=0.5", "distill.temperature=2")[1:]),
                  1)
    assert re.search(r"teacher: .*teacher, 0.0\dM parameters, 2 layers \(llama\), vocabulary 257 tokens \(264 head "
                     r"rows\); the student's tokenizer", out), out
    assert "distill: beta 0 (forward KL(teacher||student)), temperature 2, alpha 0.5 (0.5 x distillation + 0.5 x " \
           "next-token loss); the live teacher each step; off-policy" in out
    assert not (folder / "run").exists()


def test_the_cli_exits_2_on_a_stored_top_k_of_another_run_and_keeps_the_run(folder, capsys):  # row 219
    """A top-K run resumed (with a changed config) after its stored scores were deleted: one line, exit 2, and the
    run folder byte for byte as it was: the scores are read before the config history is written."""
    from helpers import train_in_process
    from shardlm.cli import main

    run_args = args(folder, "distill.teacher_topk=4", "train.max_steps=1")
    train_in_process(run_args[1:])
    for stored in (folder / "cache").rglob("teacher-topk-*"):
        stored.unlink()
    digest = folder_digest(folder / "run")
    with pytest.raises(SystemExit) as e:
        main(["resume", str(folder / "run"), "train.max_steps=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: the teacher's stored top-K scores of this run"), err
    assert "Traceback" not in "".join(err)
    assert folder_digest(folder / "run") == digest


def test_estimate_of_a_distill_step_within_15_percent_of_measured(corpus, cache_dir, tmp_path):
    """The student's step plus the teacher's parameters (held between steps, outside what measure_step_peak takes
    as resident) against the estimate, whose loss is the distillation's chunks of both models' logits (here all
    512 targets at once, at GPT-2's vocabulary: most of the peak)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.config import load_config
    from shardlm.observe.hardware import measure_step_peak
    from shardlm.preflight.estimate import estimate
    from shardlm.tokenizer import load_tokenizer
    from shardlm.training.trainer import Trainer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=384, n_head=4, n_positions=128)).save_pretrained(tmp_path / "t")
    load_tokenizer("gpt2").save_pretrained(tmp_path / "t")
    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path / "run", **{
        **GPT2_VOCAB, "train.objective": "distill", "distill.teacher": tmp_path / "t"}))
    trainer = Trainer.from_config(cfg)
    trainer.train_step()
    assert trainer.objective is not None and trainer.objective.teacher is not None
    teacher = sum(p.numel() * p.element_size() for p in trainer.objective.teacher.parameters())
    measured = measure_step_peak(trainer) + teacher
    est = estimate(cfg, trainer.run.tokenizer)
    assert est.components["teacher (fp32, sharded, frozen: no grads/state)"] == teacher
    assert est.peak_bytes == pytest.approx(measured, rel=0.15)


def test_a_live_teacher_that_transforms_its_logits_is_refused_alike(folder, tmp_path):
    """Gemma 2 soft-caps its logits in its own forward, which the chunked loss does not apply: the dry run and the
    run refuse a live teacher of that family with the same line, before the run folder exists; its top-K scores,
    taken from its own logits, are allowed."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from shardlm.tokenizer import byte_tokenizer

    (tmp_path / "corpus.txt").write_text((folder / "corpus.txt").read_text())  # a folder with no run of its own
    folder, teacher = tmp_path, tmp_path / "gemma2_teacher"
    if not teacher.exists():
        torch.manual_seed(0)
        Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, vocab_size=264, max_position_embeddings=64,
                                       bos_token_id=256, eos_token_id=256, pad_token_id=256)).save_pretrained(teacher)
        byte_tokenizer().save_pretrained(teacher)
    refused_alike(folder, [f"distill.teacher={teacher}"], r"teacher's family \(gemma2\) computes its logits in its own "
                  r"forward .*distill.teacher_topk=K")
