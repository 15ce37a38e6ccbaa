"""Fine-tuning a pretrained model from a local Hugging Face folder (the hub-loading code path, offline):
the weights reach every FSDP shard intact, and async checkpoints resume."""

import json

import pytest
import torch

from helpers import byte_gpt2_config, records, shardlm_cli, tiny
from shardlm.checkpoint.layout import is_complete, list_checkpoints
from shardlm.data import GlobalSampler
from shardlm.tokenizer import byte_tokenizer


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from transformers import GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("pretrained-gpt2")
    torch.manual_seed(123)
    model = GPT2LMHeadModel(byte_gpt2_config(n_embd=48, n_layer=2, n_head=4))
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder, model.eval()


def test_pretrained_weights_reach_every_shard(pretrained, corpus, cache_dir, tmp_path):
    folder, model = pretrained
    args = tiny(corpus, cache_dir, tmp_path, **{"model.name": folder, "model.tokenizer": folder,
                                                "train.batch_size": 4, "train.max_steps": 1, "train.lr": 1e-9})
    shardlm_cli(["train", *args], nproc=2)
    first = records(tmp_path)[0]["loss"]
    # the same first global batch, scored by the pretrained model itself
    from shardlm.config import load_config
    from shardlm.data import prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo

    cfg = load_config(None, args)
    train, _ = prepare_data(cfg.data, byte_tokenizer(), Dist(LaunchInfo("single"), torch.device("cpu")))
    blocks = train.get(GlobalSampler(len(train), cfg.train.seed).indices(0, 8))
    with torch.no_grad():
        logits = model(input_ids=blocks[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()
    assert first == pytest.approx(expected, rel=1e-5)


@pytest.mark.cuda
def test_async_checkpoints_are_complete_and_resume(corpus, cache_dir, tmp_path):
    args = tiny(corpus, cache_dir, tmp_path, **{"checkpoint.async": True, "checkpoint.every": 2,
                                                "train.max_steps": 6})
    shardlm_cli(["train", *args])
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == ["step_000000006", "step_000000004"]
    assert all(is_complete(p) is None for p in saved)
    assert json.loads((saved[0] / "trainer_state.json").read_text())["step"] == 6
    more = tiny(corpus, cache_dir, tmp_path, **{"checkpoint.async": True, "checkpoint.every": 2, "train.max_steps": 8})
    proc = shardlm_cli(["train", *more])
    assert "resumed from" in proc.stdout and max(r["step"] for r in records(tmp_path)) == 8
