"""Fine-tuning a pretrained model from a local Hugging Face folder (the hub-loading code path, offline):
the weights reach every FSDP shard intact; a model.name path that does not exist, is a file or has no
config.json, a tokenizer larger than the model's vocabulary and a seq_len beyond its positions fail in one line."""

import pytest
import torch

from helpers import byte_gpt2_config, records, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.data import GlobalSampler
from shardlm.models.hf_config import model_config
from shardlm.tokenizer import byte_tokenizer, load_tokenizer


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
    from shardlm.data import prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo

    cfg = load_config(None, args)
    train, _ = prepare_data(cfg.data, byte_tokenizer(), Dist(LaunchInfo("single"), torch.device("cpu")))
    blocks = train.get(GlobalSampler(len(train), cfg.train.seed).indices(0, 8))
    with torch.no_grad():
        logits = model(input_ids=blocks[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()
    assert first == pytest.approx(expected, rel=1e-5)


def test_tokenizer_larger_than_model_vocab(tmp_path):
    byte_gpt2_config(n_positions=1024).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name={tmp_path}", "model.tokenizer=gpt2"])
    with pytest.raises(ShardlmError, match="50257 tokens but the model's vocabulary holds 257"):
        model_config(cfg, load_tokenizer("gpt2"))


def test_seq_len_beyond_pretrained_positions(tmp_path):
    byte_gpt2_config().save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name={tmp_path}", "data.seq_len=128"])
    with pytest.raises(ShardlmError, match="data.seq_len=128 exceeds the model's 64 positions"):
        model_config(cfg, byte_tokenizer())


def test_a_mistyped_model_path_is_named_before_the_tokenizer(tmp_path):
    """`model.name=./mymodle` blamed the tokenizer (and advised model.tokenizer=gpt2): the path comes first."""
    (tmp_path / "mymodel").mkdir()
    byte_gpt2_config().save_pretrained(tmp_path / "mymodel")
    proc = shardlm_cli(["train", "model.name=./mymodle", "out_dir=run", "data.cache_dir=cache"], check=False,
                       cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: model.name './mymodle' is a path that does not exist. Did you mean './mymodel'? Point model.name at "
        "a folder holding config.json and the weights (saved with save_pretrained or `shardlm export`), or give a "
        "hub name such as gpt2."), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mymodel"]  # nothing read or written


def test_a_model_path_that_is_a_file_or_a_folder_without_config(tmp_path):
    from shardlm.hub import check_model_path
    from shardlm.tokenizer import model_tokenizer

    byte_gpt2_config().save_pretrained(tmp_path / "m")
    (tmp_path / "empty").mkdir()
    (tmp_path / "sft" / "checkpoints").mkdir(parents=True)  # a run folder: the next step of the flow is to export
    for name, message in ((tmp_path / "m" / "config.json", "config.json' is a file, not a folder. Point model.name"),
                          (tmp_path / "empty", "empty': it is a folder without a config.json."),
                          (tmp_path / "sft", rf"a shardlm run or checkpoint is exported first: shardlm export "
                                          rf"{tmp_path}/sft {tmp_path}/sft-hf, then model.name={tmp_path}/sft-hf\."),
                          (tmp_path / "runs" / "m", "m' is a path that does not exist. Point model.name")):
        with pytest.raises(ShardlmError, match=message):
            model_tokenizer(load_config(None, [f"model.name={name}"]).model)
    check_model_path(str(tmp_path / "m"))
    check_model_path("some-org/model")  # a hub name: the hub decides


def test_transformers_padding_alarm_is_dropped_for_shardlms_packed_rows(hf_folder):
    """Rows ending with EOS (= the pad id of most models) made transformers print two lines in runs on text pairs;
    shardlm's rows carry their own positions and sequence ids. The filter drops that message only, and it is the
    message transformers writes."""
    import inspect
    import logging

    from transformers import AutoModelForCausalLM, PreTrainedModel

    from shardlm.models.causal_lm import CausalLM

    CausalLM(AutoModelForCausalLM.from_pretrained(hf_folder))
    logger = logging.getLogger("transformers.modeling_utils")

    def passes(message: str) -> bool:
        return bool(logger.filter(logging.LogRecord(logger.name, logging.WARNING, "", 0, message, None, None)))

    alarm = "We strongly recommend passing in an `attention_mask` since your input_ids may be padded."
    assert alarm.split(" since")[0] in inspect.getsource(PreTrainedModel.warn_if_padding_and_no_attention_mask)
    assert not passes(alarm) and passes("Some weights of the model checkpoint were not used")
