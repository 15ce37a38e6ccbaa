"""The Hugging Face Hub: export's model card (README.md + loss.png); `export --push-to-hub` failing as one line
offline, without a token or unreachable, the export kept; `--private` without it refused; a model, tokenizer or
`hf:` dataset named on the Hub while it cannot be reached, and a model loaded offline from the HF cache."""

import json

import pytest

from helpers import byte_gpt2_config
from shardlm import ShardlmError
from shardlm.cli import main
from shardlm.config import load_config
from shardlm.inference.export import run_facts, write_card
from shardlm.models.hf_config import model_config
from shardlm.tokenizer import byte_tokenizer, load_tokenizer


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
                 'pipeline("text-generation", model="me/tiny")', "do_sample=True, temperature=0.8",
                 "# greedy", "![training and validation loss]",
                 "## Limitations and license"]:
        assert part in card, part
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_a_preference_runs_card_names_its_objective_and_rewards_and_a_chat_model_is_used_with_messages(tmp_path):
    """A pair loss has no perplexity and its accuracy is the rewards': the card says which numbers these are."""
    from transformers import GPT2LMHeadModel

    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_10"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 10, "world_size": 1}))
    stats = {"rewards/chosen": 0.02, "rewards/rejected": -0.03, "rewards/accuracy": 0.75, "rewards/margin": 0.05}
    lines = [{"step": 10, "split": "train", "loss": 0.68, "tokens": 640, **stats},
             {"step": 10, "split": "val", "loss": 0.69, "ppl": 18902.6, "accuracy": 0.75, "pairs": 4, "tokens": 16,
              "held_out_tokens": 16, **stats}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = load_config(overrides=["data.train=pairs.jsonl", "train.objective=dpo", "preference.beta=0.5"])
    (tmp_path / "out").mkdir()
    write_card(tmp_path / "out", GPT2LMHeadModel(byte_gpt2_config(n_positions=32)), cfg, ckpt, "me/tiny", chat=True)
    card = (tmp_path / "out" / "README.md").read_text()
    for part in ["| objective | dpo on preference pairs (preference.beta 0.5, reference precomputed) |",
                 "| final train loss | 0.6800 at step 10 |",
                 "| final validation loss | 0.6900 rewards/accuracy 0.750 rewards/margin 0.0500 (chosen 0.0200, "
                 "rejected -0.0300) on 4 pairs, all 16 held-out tokens at step 10 |",
                 'messages = [{"role": "user"', '[0]["generated_text"][-1]["content"]']:
        assert part in card, part
    assert "perplexity" not in card and "final validation accuracy" not in card and "ROMEO" not in card


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


@pytest.mark.parametrize("env, message", [
    ({"HF_HUB_OFFLINE": "1"}, "--push-to-hub: HF_HUB_OFFLINE is set, so nothing was uploaded; the export in"),
    ({"HF_TOKEN": ""}, "--push-to-hub needs a Hugging Face token with write access: set HF_TOKEN"),
])
def test_push_to_hub_offline_or_without_token(hf_folder, tmp_path, monkeypatch, env, message):
    from huggingface_hub import constants

    from shardlm.hub import push_folder
    from shardlm.inference.export import export

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login` token
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = export(hf_folder, tmp_path / "out", repo_id="me/tiny")
    with pytest.raises(ShardlmError, match=message) as error:
        push_folder(out, "me/tiny")
    assert "\n" not in str(error.value) and (out / "model.safetensors").is_file()


def test_private_applies_to_push_to_hub(tmp_path):
    from shardlm.cli import cmd_export, parse_args

    with pytest.raises(ShardlmError, match="--private applies to --push-to-hub"):
        cmd_export(parse_args(["export", str(tmp_path / "no-run"), str(tmp_path / "out"), "--private"]))


@pytest.fixture
def hub_unreachable(monkeypatch, tmp_path):
    """The Hub's endpoint is a closed local port and the HF cache an empty folder, on any machine."""
    from huggingface_hub import constants

    from shardlm.hub import hub_reachable

    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    hub_reachable.cache_clear()
    yield tmp_path / "hf-cache"
    hub_reachable.cache_clear()


def test_unreachable_model_name_says_offline_and_local_folder(hub_unreachable):
    cfg = load_config(None, ["model.name=no-such-org/no-such-model-xyz"])
    with pytest.raises(ShardlmError, match="Hub cannot be reached and it is not in the local HF cache.*local folder"):
        model_config(cfg, byte_tokenizer())


def test_unreachable_hub_tokenizer_and_dataset(hub_unreachable):
    from shardlm.data.sources import Source, iter_documents

    with pytest.raises(ShardlmError, match="tokenizer 'no-org/tok': .*Hub cannot be reached.*model.tokenizer=gpt2"):
        load_tokenizer("no-org/tok")
    with pytest.raises(ShardlmError, match="Hub cannot be reached.*point data.train/data.val at local"):
        next(iter_documents(Source("hf:wikitext", hf=("wikitext", None, "train"))))


def test_hub_name_loads_from_the_local_hf_cache_offline(hub_unreachable):
    """A model downloaded earlier (HF cache layout) loads by its hub name with no network."""
    snapshot = hub_unreachable / "models--some-org--tiny-gpt2" / "snapshots" / ("0" * 40)
    byte_gpt2_config().save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    tokenizer = load_tokenizer("some-org/tiny-gpt2")
    cfg = load_config(None, ["model.name=some-org/tiny-gpt2", "data.seq_len=32"])
    assert model_config(cfg, tokenizer).n_positions == 64
