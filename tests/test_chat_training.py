"""Training on examples end to end: 2 ranks = 1 process (the loss is the mean over the global batch's targets),
exact resume, a chat source beside a text source, and an export whose template gives the training ids."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
from faults import fault

from helpers import by_step, records, shardlm_cli, tiny


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """Conversations of very different lengths (1-3 exchanges), so micro-batches differ in target counts."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    lines = []
    for _ in range(160):
        messages = []
        for _ in range(rng.randint(1, 3)):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 9)))
            messages += [{"role": "user", "content": f"Reverse: {word}"},
                         {"role": "assistant", "content": word[::-1]}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def chat_args(chat_file, cache_dir, out, **extra):
    return ["train", *tiny(chat_file, cache_dir, out, **{"model.chat_template": "chatml", "data.seq_len": 64,
                                                         "model.n_positions": 64, "train.max_steps": 8, **extra})]


@pytest.fixture(scope="module")
def one_process(chat_file, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    shardlm_cli(chat_args(chat_file, cache_dir, out, **{"train.batch_size": 8, "train.eval_every": 4}))
    return out


def test_two_ranks_train_what_one_process_trains_on_examples(one_process, chat_file, cache_dir, tmp_path):
    shardlm_cli(chat_args(chat_file, cache_dir, tmp_path, **{"train.batch_size": 2, "train.grad_accum": 2,
                                                             "train.eval_every": 4}), nproc=2)
    got, want = records(tmp_path), records(one_process)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-4)
        assert 0 < a["target_fraction"] < 0.5
    assert [r["loss"] for r in records(tmp_path, "val")] == pytest.approx(
        [r["loss"] for r in records(one_process, "val")], rel=1e-4)
    assert got[-1]["loss"] < got[0]["loss"]


def test_resume_on_examples_is_exact(one_process, chat_file, cache_dir, tmp_path):
    args = chat_args(chat_file, cache_dir, tmp_path, **{"train.batch_size": 8, "train.eval_every": 4,
                                                        "checkpoint.every": 4})
    assert shardlm_cli([*args, fault("KillAfterSave(4)")], check=False).returncode != 0
    assert max(by_step(tmp_path)) == 4
    shardlm_cli(args)
    assert by_step(tmp_path) == by_step(one_process)  # bit for bit


def test_export_renders_with_the_training_template_and_pipeline_chats(one_process, chat_file, cache_dir, tmp_path):
    from transformers import AutoTokenizer, pipeline

    from shardlm.data.examples import load_examples

    shardlm_cli(["export", str(one_process), str(tmp_path / "hf")])
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = json.loads(chat_file.read_text().splitlines()[0])["messages"]
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    sets = [load_examples(p) for p in cache_dir.glob("ex-*") if (p / "meta.json").is_file()]
    first, _ = next(s for s in sets if s.meta["source"] == str(chat_file)).example(0)
    assert list(ids) == first.tolist()
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    out = pipeline("text-generation", model=str(tmp_path / "hf"))(messages[:1], max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"][-1]["role"] == "assistant"


def test_a_chat_source_beside_a_text_source_keeps_its_own_masking(chat_file, corpus, cache_dir, tmp_path):
    proc = shardlm_cli(chat_args(chat_file, cache_dir, tmp_path, **{
        "data.train": json.dumps([str(corpus), str(chat_file)]), "data.weights": "[1, 1]", "train.max_steps": 4}))
    assert "chat examples (messages)" in proc.stdout
    fractions = [r["target_fraction"] for r in records(tmp_path)]
    assert all(0.5 < f < 1 for f in fractions)  # text blocks: every token; chat rows: answers only
    assert np.isfinite([r["loss"] for r in records(tmp_path)]).all()


def test_dry_run_shows_the_trained_tokens_and_eval_generate_speak_chat(one_process, chat_file, cache_dir, tmp_path):
    out = tmp_path / "dry"
    proc = shardlm_cli([*chat_args(chat_file, cache_dir, out), "--dry-run"])
    assert "chat (messages, detected from its fields)" in proc.stdout
    assert "<|im_start|>user\nReverse: " in proc.stdout and "<|im_end|>\n⟧" in proc.stdout
    assert not out.exists()
    result = json.loads(shardlm_cli(["eval", str(one_process), "--exact-match", "4", "--generation", "4"]).stdout)
    assert result["exact_match_n"] == 4 and 0 <= result["exact_match"] <= 1 and result["tokens"] > 0
    assert result["generation"]["prompts"] == 4 and "rouge_l" in result["generation"]  # answers vs references
    reply = shardlm_cli(["generate", str(one_process), "--chat", "--prompt", "Reverse: ab", "--temperature", "0",
                         "--max-new-tokens", "6", "--json"])
    assert json.loads(reply.stdout)["messages"] == [{"role": "user", "content": "Reverse: ab"}]
    (tmp_path / "m.json").write_text('{"role": "user"}')
    for args, message in ((["eval", str(one_process), "--stride", "8"], "--stride scores continuations of text; the "
                            "validation data holds examples. Score their answers with --exact-match N"),
                          (["generate", str(one_process), "--chat", "--messages", str(tmp_path / "m.json")],
                           "must hold a non-empty list of"),
                          (["generate", str(one_process), "--chat"], "--chat without --prompt or --messages is an "
                                                                     "interactive loop and needs a terminal")):
        proc = shardlm_cli(args, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_run_on_answer_in_the_closing_sample_is_clipped():
    """An early model that never ends its turn writes up to train.sample_tokens per answer: the console shows
    its start and how much more there is."""
    from shardlm.runner import _clipped

    assert _clipped("olleh") == "'olleh'"
    assert _clipped(" noticing" * 60) == repr((" noticing" * 60)[:160]) + "... (380 more characters)"
