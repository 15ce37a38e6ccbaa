"""KTO through the objective seam: unpaired {"prompt", "completion", "label"} records, the loss at the start
equal to TRL's (policy = reference: 1 - sigmoid(0) for every example), 2 ranks = 1 process, an exact resume, and
one line for each kind of bad record. The loss itself equals TRL 1.16's in value and gradient in test_kto_loss.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from faults import fault

from helpers import records, shardlm_cli, tiny


@pytest.fixture(scope="module")
def kto_file(tmp_path_factory) -> Path:
    """Reversals answered right (desirable) or wrong (undesirable), unpaired and unevenly many of each."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("kto") / "kto.jsonl"
    lines = []
    for _ in range(160):
        word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 6)))
        right = rng.random() < 0.6
        lines.append(json.dumps({"prompt": [{"role": "user", "content": f"Reverse: {word}"}],
                                 "completion": [{"role": "assistant", "content": word[::-1] if right else word}],
                                 "label": right}))
    path.write_text("\n".join(lines) + "\n")
    return path


def kto_args(kto_file, cache_dir, out, **extra):
    return ["train", *tiny(kto_file, cache_dir, out, **{
        "model.chat_template": "chatml", "data.seq_len": 96, "model.n_positions": 96, "train.objective": "kto",
        "train.max_steps": 6, "train.batch_size": 2, "train.grad_accum": 2, "train.eval_every": 3,
        "preference.beta": 0.5, **extra})]


@pytest.fixture(scope="module")
def kto_one(kto_file, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kto_one")
    shardlm_cli(kto_args(kto_file, cache_dir, out))
    return out


def _train(out: Path) -> list[dict]:
    return records(out)


def test_kto_starts_at_trls_loss_and_learns_its_labels(kto_one):
    train = _train(kto_one)
    assert len(train) == 6
    first = train[0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sigmoid(0), whatever the label
    assert first["kl"] == 0.0 and first["count/chosen"] + first["count/rejected"] > 0
    val = records(kto_one, "val")
    assert val and {"kl", "rewards/chosen", "rewards/rejected", "examples"} <= set(val[-1])
    assert val[-1]["loss"] != pytest.approx(0.5, abs=1e-6)  # it moved off the reference


def test_kto_two_ranks_train_what_one_process_trains(kto_one, kto_file, cache_dir, tmp_path):
    """The reference point is taken over the step (every micro-batch of every rank), so the sharded run's steps
    are the single process's: 2 ranks x 1 micro-batch of 2 = 1 process x 2 micro-batches of 2. The 2 ranks score a
    live reference (a frozen copy sharded as the policy), the one process the precomputed one: the same values."""
    shardlm_cli(kto_args(kto_file, cache_dir, tmp_path, **{"train.grad_accum": 1, "preference.reference": "live"}),
                nproc=2)
    got, want = _train(tmp_path), _train(kto_one)
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"], a["kl"]) == pytest.approx((b["loss"], b["grad_norm"], b["kl"]), rel=1e-4,
                                                                     abs=1e-7)


def test_kto_resume_is_exact(kto_one, kto_file, cache_dir, tmp_path):
    args = kto_args(kto_file, cache_dir, tmp_path, **{"checkpoint.every": 3})
    assert shardlm_cli([*args, fault("KillAfterSave(3)")], check=False).returncode != 0
    shardlm_cli(args)
    got = {r["step"]: (r["loss"], r["kl"]) for r in _train(tmp_path)}
    want = {r["step"]: (r["loss"], r["kl"]) for r in _train(kto_one)}
    assert got == want


@pytest.mark.parametrize("record, says", [
    ({"prompt": "a", "completion": "b"}, "lacks 'label'"),
    ({"prompt": "a", "completion": "b", "label": "yes"}, "'label' must be true or false"),
    ({"prompt": "a", "label": True}, "lacks 'completion'"),
])
def test_a_bad_kto_record_is_one_line_with_its_place(kto_file, cache_dir, tmp_path, record, says):
    data = tmp_path / "bad.jsonl"
    lines = kto_file.read_text().splitlines()[:20]
    lines.insert(7, json.dumps(record))
    data.write_text("\n".join(lines) + "\n")
    proc = shardlm_cli(kto_args(data, cache_dir, tmp_path / "run"), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and f"{data}:8" in errors[0] and says in errors[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_kto_derivation_rotates_completions_within_runs(kto_file, cache_dir, tmp_path):
    """TRL's KL pairs: each record's mismatched completion is the previous one's within runs of the batch size."""
    from shardlm.config import load_config
    from shardlm.objectives.preference.kto import derive

    cfg = load_config(None, [f"data.train={kto_file}", "train.batch_size=4", "train.objective=kto"])
    path, _ = derive(str(kto_file), cfg, tmp_path, "train", "train")
    pairs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    source = [json.loads(line) for line in kto_file.read_text().splitlines()]
    assert [p["chosen"] for p in pairs] == [s["completion"] for s in source]
    assert pairs[0]["rejected"] == source[3]["completion"] and pairs[1]["rejected"] == source[0]["completion"]
    assert pairs[4]["rejected"] == source[7]["completion"]  # the next run starts again
    labels = np.load(tmp_path / "train.labels.npy")
    assert labels.tolist() == [s["label"] for s in source]


def test_a_resume_that_changes_the_objective_is_refused_unless_allowed(kto_one, kto_file, cache_dir, tmp_path):
    """docs/checkpoints.md: a resume keeps what the run optimizes (its objective and that objective's section);
    the learning rate or the steps change freely, and checkpoint.allow_changes=true allows the rest, once."""
    import shutil

    from helpers import folder_digest

    run = tmp_path / "run"
    shutil.copytree(kto_one, run)
    before = folder_digest(run)
    for change, says in (("preference.beta=0.9", "preference.beta 0.5 -> 0.9"),
                         ("train.objective=sft", "train.objective kto -> sft")):
        proc = shardlm_cli([*kto_args(kto_file, cache_dir, run, **{"train.max_steps": 7}), change], check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1 and says in errors[0] \
            and "checkpoint.allow_changes=true" in errors[0], proc.stderr
        assert folder_digest(run) == before  # nothing written
    shardlm_cli([*kto_args(kto_file, cache_dir, run, **{"train.max_steps": 7}), "preference.beta=0.9",
                 "checkpoint.allow_changes=true"])
    assert records(run)[-1]["step"] == 7
    assert "allow_changes: false" in (run / "config.yaml").read_text()  # one invocation's permission


def test_prepare_says_kto_data_is_derived_by_the_run(kto_file, cache_dir, tmp_path):
    proc = shardlm_cli(["prepare", f"data.train={kto_file}", f"data.cache_dir={tmp_path}", "train.objective=kto"],
                       check=False)
    assert proc.returncode == 2 and "the run derives and renders them once" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())


def test_the_model_card_says_kto_and_no_perplexity(kto_one, tmp_path):
    """The exported card names the objective with its settings and gives its loss in its own words (kl and rewards):
    exp of a KTO loss is no perplexity."""
    shardlm_cli(["export", str(kto_one), str(tmp_path / "hf")])
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "kto on labelled examples (preference.beta 0.5, kto_loss_type kto" in card
    losses = [line for line in card.splitlines() if "final train loss" in line or "final validation loss" in line]
    assert len(losses) == 2 and not any("perplexity" in line for line in losses), losses
    assert "kl" in losses[1] and "rewards/chosen" in losses[1]


def test_a_validation_with_one_label_only_is_described_and_exported(kto_file, cache_dir, tmp_path):
    """Validation examples of one label have no rewards for the other side (null in metrics.jsonl): the run's
    line and the exported card say n/a instead of failing on it."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(line + "\n" for line in kto_file.read_text().splitlines()
                           if json.loads(line)["label"] is False))
    run = tmp_path / "run"
    proc = shardlm_cli(kto_args(kto_file, cache_dir, run, **{"data.val": val, "train.max_steps": 2,
                                                             "train.eval_every": 2}))
    assert "rewards/chosen n/a" in proc.stdout + proc.stderr
    assert records(run, "val")[-1]["rewards/chosen"] is None
    shardlm_cli(["export", str(run), str(tmp_path / "hf")])
    assert "rewards/chosen n/a" in (tmp_path / "hf" / "README.md").read_text()
