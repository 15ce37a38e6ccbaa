"""Export's model card (README.md + loss.png) and `export --push-to-hub` failing as one line offline."""

import json

import pytest
import torch

from helpers import byte_gpt2_config
from shardlm.cli import main
from shardlm.config import load_config
from shardlm.inference.export import run_facts, write_card
from shardlm.tokenizer import byte_tokenizer


@pytest.fixture
def hf_folder(tmp_path):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(byte_gpt2_config(n_positions=32)).save_pretrained(tmp_path / "hf")
    byte_tokenizer().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_model_card_has_data_steps_losses_config_and_loading(tmp_path):
    from transformers import GPT2LMHeadModel

    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_20"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 20, "world_size": 2}))
    lines = [{"step": 10, "split": "train", "loss": 3.0, "tokens": 5120},
             {"step": 20, "split": "train", "loss": 2.0, "tokens": 10240},
             {"step": 20, "split": "val", "loss": 2.5, "ppl": 12.18, "accuracy": 0.31},
             {"step": 30, "split": "train", "loss": 1.0, "tokens": 15360}]  # after the checkpoint: not its numbers
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = load_config(overrides=["data.train=corpus.txt", "data.seq_len=32", "train.lr=0.001"])
    facts = run_facts(ckpt)
    assert facts["step"] == 20 and facts["train"]["tokens"] == 10240 and facts["val"]["loss"] == 2.5
    model = GPT2LMHeadModel(byte_gpt2_config(n_positions=32))
    write_card(tmp_path, model, cfg, ckpt, "me/tiny")
    card = (tmp_path / "README.md").read_text()
    for part in ["library_name: transformers", "| training data | corpus.txt |", "| steps | 20 |",
                 "| tokens seen | 10,240 |", "| final train loss | 2.0000 (perplexity 7.39) at step 20 |",
                 "| final validation loss | 2.5000 (perplexity 12.18) at step 20 |", "trained from scratch",
                 "seq_len 32, batch 32 x grad_accum 1 x 2 rank(s), lr 0.001", "context 32, vocabulary 257",
                 'pipeline("text-generation", model="me/tiny")', "do_sample=False", "![training and validation loss]",
                 "## Limitations and license"]:
        assert part in card, part
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_push_to_hub_unreachable_is_one_line_and_keeps_the_export(hf_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: connection refused
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(hf_folder), str(out), "--push-to-hub", "me/tiny", "--private"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "--push-to-hub me/tiny failed (http://127.0.0.1:9:" in line and f"the export in '{out}' is complete" in line
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out) is not None and (out / "README.md").is_file()
    assert 'model="me/tiny"' in (out / "README.md").read_text()


def test_the_card_names_a_mixture_with_its_weights():
    from shardlm.config import load_config
    from shardlm.inference.export import _data

    mix = load_config(overrides=["data.train=[a.txt,b.parquet]", "data.weights=[0.7,0.3]"]).data
    assert _data(mix) == "a mixture of a.txt (0.7), b.parquet (0.3)"
    assert _data(load_config(overrides=["data.train=c.txt"]).data) == "c.txt"
