"""The teacher's top-K scores stored once (`distill.teacher_topk`): the stored values are the teacher's own top K
of each target; a killed scoring goes on where it stopped, and past the first step an unfinished, damaged or
foreign store is refused with the fix instead of being used."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import tiny
from shardlm import ShardlmError
from shardlm.models.loss import IGNORE

CHAT = Path(__file__).resolve().parent.parent / "shardlm" / "assets" / "chat_tasks" / "train.jsonl"
K, TEMPERATURE = 8, 2.0


@pytest.fixture
def chat_run(tmp_path):
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:120]))
    args = tiny(data, tmp_path / "cache", tmp_path / "out", **{
        "model.tokenizer": "bytes", "model.chat_template": "chatml", "data.seq_len": 96, "model.n_positions": 96,
        "train.batch_size": 8})
    return Trainer.from_config(load_config(None, args)).run


def _prepare(run, **kwargs):
    from shardlm.objectives.distill.teacher_scores import prepare_teacher_topk

    return prepare_teacher_topk(run, run.model, K, TEMPERATURE, identity={"teacher": "itself"}, **kwargs)


def _direct(run, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top K at the targets of `rows`, straight from the HF model."""
    batch, hf = run.train.batch(rows), run.model.hf.eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.inputs, position_ids=batch.positions).logits
    logps = (logits.flatten(0, 1)[batch.targets.flatten() != IGNORE][:, :len(run.tokenizer)] / TEMPERATURE)
    top = logps.log_softmax(-1).topk(K, -1)
    return top.indices, top.values


def test_a_killed_scoring_goes_on_and_stores_the_teachers_top_k(chat_run, capsys):
    run, body, calls = chat_run, chat_run.model._body, []

    def killed_after_two(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return body(*args, **kwargs)

    run.model._body = killed_after_two
    with pytest.raises(KeyboardInterrupt):
        _prepare(run)
    with pytest.raises(ShardlmError, match="never completed.*checkpoint.resume=none"):
        _prepare(run, step=1)  # a resumed run does not train on an unfinished store
    calls.clear()
    run.model._body = lambda *a, **k: calls.append(1) or body(*a, **k)
    scores = _prepare(run)
    rounds = -(-len(run.train) // 8) + -(-len(run.val) // 8)
    assert "continued" in capsys.readouterr().out and len(calls) == rounds - 2
    rows = np.array([5, 0, 11, len(run.train) - 1])
    got = scores.for_rows("train", rows, run.train.batch(rows))
    ids, logps = _direct(run, rows)
    assert len(ids) > 10 and torch.equal(got.ids, ids) and torch.allclose(got.logps, logps, atol=1e-5)
    calls.clear()
    _prepare(run, step=3)  # complete: read back, nothing scored
    assert not calls


def test_a_foreign_or_damaged_store_is_refused_past_the_first_step(chat_run, capsys):
    run = chat_run
    key = _prepare(run).key["train"]
    folder = Path(run.train.examples.meta["folder"])
    header = folder / f"teacher-topk-{key}.json"
    saved = json.loads(header.read_text())
    header.write_text(json.dumps({**saved, "teacher": {"teacher": "another"}}))
    with pytest.raises(ShardlmError, match="another teacher than this run's.*Delete .*teacher-topk-"):
        _prepare(run)
    header.write_text(json.dumps(saved))
    logps = folder / f"teacher-topk-{key}.logps.npy"
    with open(logps, "r+b") as fh:
        fh.seek(200)
        fh.write(b"\x00" * 64)
    with pytest.raises(ShardlmError, match="was changed since it was written.*cannot be read back.*Delete"):
        _prepare(run, step=2)
    capsys.readouterr()
    _prepare(run)  # before the first step: scored again
    assert "computed again" in capsys.readouterr().out
    for path in folder.glob(f"teacher-topk-{key}.*"):
        path.unlink()
    with pytest.raises(ShardlmError, match="are missing: the cache was cleared, or distill.teacher"):
        _prepare(run, step=2)
