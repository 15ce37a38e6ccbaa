"""On-policy distillation (shardlm.objectives.distill.samples): which steps train on the student's completions (keyed
by seed and step: a share near distill.on_policy, the same on every run), and what such a step trains on: each
example's prompt with a completion the student samples, exactly what the RL sampler draws for that prompt with the
example's keyed seed, its tokens the targets, scored by the teacher as the whole-logits reference scores them; 2
ranks sample and train what one process does."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from faults import fault

from helpers import by_step, records, shardlm_cli, tiny
from shardlm.data.blocks import IGNORE


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """Short conversations of one or two exchanges: several examples to a packed row, a later turn to cut."""
    rng = random.Random(0)
    lines = []
    for _ in range(64):
        messages = []
        for _ in range(rng.randint(1, 2)):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 3)))
            messages += [{"role": "user", "content": f"R {word}"}, {"role": "assistant", "content": word[::-1]}]
        lines.append(json.dumps({"messages": messages}))
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_on_policy_steps_are_keyed_and_take_their_share():
    """The decision of a step depends on (seed, step) alone: the same list on every call (so on any world size
    and after a resume), another list for another seed, a share near the fraction, none at 0, all at 1."""
    from shardlm.objectives.distill.samples import on_policy_step

    steps = range(4000)
    draws = [on_policy_step(7, s, 0.3) for s in steps]
    assert draws == [on_policy_step(7, s, 0.3) for s in steps]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.03, sum(draws) / len(draws)
    assert draws != [on_policy_step(8, s, 0.3) for s in steps]
    assert [on_policy_step(7, s, 0.6) for s in steps] >= draws  # a larger fraction keeps the same steps and more
    assert not any(on_policy_step(7, s, 0.0) for s in steps) and all(on_policy_step(7, s, 1.0) for s in steps)


def test_the_targets_are_the_students_own_keyed_samples(chat_file, cache_dir, tmp_path):
    """On a packed micro-batch of chat examples: every example keeps its prompt (its ids before its first answer
    token, a second exchange dropped) and gets, as targets, exactly the completion the RL sampler draws for that
    prompt alone with the example's keyed seed, up to and including the end of turn where it stopped, else
    distill.max_new_tokens long; the sampled rows are packed into data.seq_len."""
    from shardlm.config import load_config
    from shardlm.objectives.distill.samples import example_key, row_keys, sampling_params, student_completions
    from shardlm.objectives.rl.sampling import TransformersSampler
    from shardlm.tokenizer import end_of_turn_id
    from shardlm.training.trainer import Trainer

    cfg = load_config(None, tiny(chat_file, cache_dir, tmp_path, **{
        "model.chat_template": "chatml", "data.seq_len": 64, "train.batch_size": 4, "model.dropout": 0.0,
        "distill.max_new_tokens": 8, "distill.sample_temperature": 0.8}))
    trainer = Trainer.from_config(cfg)
    run, tok = trainer.run, trainer.run.tokenizer
    eot = end_of_turn_id(tok)
    with torch.no_grad():  # the end of turn likely at some positions and not at others: both kinds of completion
        run.model.hf.get_input_embeddings().weight[eot] *= 8
    batch = trainer.train_batch(0)
    keys = row_keys(1000, batch.inputs.shape[0])
    sampled = student_completions(run.model, batch, tok, cfg, keys)

    rows = run.train
    want = []  # (prompt, key) of each example of the micro-batch, from the example cache itself
    for r, row in enumerate(rows.rows[i] for i in trainer.indices(0, 0)):
        for slot, k in enumerate(row):
            ids, mask = rows.examples.example(int(rows.ids[k]))
            want.append((ids[:int(np.flatnonzero(mask)[0])].tolist(), example_key(int(keys[r]), slot)))
    got = segments(sampled)
    assert sorted(p for p, _ in got) == sorted(p for p, _ in want)
    assert sampled.inputs.shape[1] == 64 and len(got) > sampled.inputs.shape[0]  # packed, several to a row
    sampler = TransformersSampler(run.model.hf, tok.eos_token_id, vocab=run.model.vocab)
    params = sampling_params(tok, cfg, 8)
    ends = []
    for prompt, key in want:
        alone = sampler.sample([prompt], [key], params).completions[0]
        assert (prompt, alone) in got
        assert alone[-1] in params.stop or len(alone) == 8
        ends.append(alone[-1] in params.stop)
    assert any(ends) and not all(ends), ends
    again = student_completions(run.model, batch, tok, cfg, keys)
    assert all(torch.equal(a, b) for a, b in zip(again[:3], sampled[:3], strict=True))
    other = student_completions(run.model, batch, tok, cfg, keys + 1)
    assert sorted(segments(other)) != sorted(got)


def segments(batch) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) of each example of a sampled micro-batch: the ids before its first target's token and
    its targets."""
    out = []
    for inputs, targets, positions in zip(*(t.numpy() for t in batch[:3]), strict=True):
        starts = [*np.flatnonzero(positions == 0).tolist(), len(inputs)]
        for a, b in zip(starts, starts[1:], strict=False):
            scored = np.flatnonzero(targets[a:b] != IGNORE)
            if len(scored):
                first, last = a + int(scored[0]), a + int(scored[-1])
                out.append((inputs[a:first + 1].tolist(), targets[first:last + 1].tolist()))
                assert inputs[first + 1:last + 2].tolist() == out[-1][1]
    return out


def on_policy_args(chat_file, cache_dir, out, teacher, **extra) -> list[str]:
    return tiny(chat_file, cache_dir, out, **{
        "train.objective": "distill", "distill.teacher": teacher, "model.chat_template": "chatml",
        "data.seq_len": 64, "model.n_positions": 64, "model.dropout": 0.0, "distill.max_new_tokens": 8,
        "distill.beta": 0.5, "distill.alpha": 0.7, **extra})


def test_an_on_policy_step_is_the_teachers_loss_on_the_students_samples(chat_file, cache_dir, tmp_path):
    """With distill.on_policy=1 the step trains on the micro-batch `student_completions` gives (the student's keyed
    samples, drawn before the step) and its loss is the whole-logits reference's divergence on that batch, the
    teacher scoring the sampled tokens: distill.alpha's next-token part is left out (a sample is no label);
    distill/on_policy counts all of them."""
    from test_distill_training import save_teacher

    from shardlm.config import load_config
    from shardlm.models.distill_loss import full_distill_loss
    from shardlm.objectives.distill.samples import row_keys, student_completions
    from shardlm.training.trainer import Trainer

    teacher = save_teacher(tmp_path / "teacher", seed=0, chatml=True)
    cfg = load_config(None, on_policy_args(chat_file, cache_dir, tmp_path / "run", teacher, **{
        "distill.on_policy": 1.0, "train.batch_size": 4}))
    trainer = Trainer.from_config(cfg)
    student, frozen = trainer.model, trainer.objective.teacher
    sampled = student_completions(student, trainer.train_batch(0), trainer.run.tokenizer, cfg, row_keys(0, 4))
    inputs, positions = sampled.inputs, sampled.positions
    with torch.no_grad():
        want, _ = full_distill_loss(student.hf(inputs, position_ids=positions).logits,
                                    frozen.hf(inputs, position_ids=positions).logits, sampled.targets, beta=0.5,
                                    temperature=1.0, alpha=1.0, vocab=259)
    result = trainer.train_step()
    targets = int((sampled.targets != IGNORE).sum())
    assert result["targets"] == targets and float(result["stats"][4]) == targets
    assert float(result["loss_sum"]) == pytest.approx(float(want), rel=1e-5)


def test_two_ranks_sample_and_train_what_one_process_does(chat_file, cache_dir, tmp_path):
    """distill.on_policy=0.5 over 6 steps (4 of them on the student's samples, keyed by the seed and the step):
    2 ranks x 2 accumulated micro-batches of 1 row sample the same completions and train the same losses as one
    process with rows of 4; a run killed after its step-3 checkpoint resumes to the uninterrupted losses (its next
    step samples again, with nothing of the sampling in the checkpoint)."""
    from test_distill_training import save_teacher

    teacher = save_teacher(tmp_path / "teacher", seed=0, chatml=True)

    def args(out, **extra):
        return ["train", *on_policy_args(chat_file, cache_dir, out, teacher, **{
            "distill.on_policy": 0.5, "train.max_steps": 6, **extra})]

    shardlm_cli(args(tmp_path / "one", **{"train.batch_size": 4}))
    shardlm_cli(args(tmp_path / "two", **{"train.batch_size": 1, "train.grad_accum": 2}), nproc=2)
    got, want = records(tmp_path / "two"), records(tmp_path / "one")
    assert [r["distill/on_policy"] for r in want] == [1, 1, 1, 1, 0, 0]
    keys = ("loss", "distill/loss", "distill/nll", "distill/on_policy")
    for a, b in zip(got, want, strict=True):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5, abs=1e-5)
    resumed = args(tmp_path / "resumed", **{"train.batch_size": 4, "checkpoint.every": 3})
    assert shardlm_cli([*resumed, fault("KillAfterSave(3)")], check=False).returncode != 0
    shardlm_cli(resumed)
    got_steps, want_steps = by_step(tmp_path / "resumed"), by_step(tmp_path / "one")
    assert list(got_steps) == list(want_steps)
    assert list(got_steps.values()) == pytest.approx(list(want_steps.values()), rel=1e-6)
