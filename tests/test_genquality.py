"""Generation-quality metrics against values worked out by hand, and their use on a tiny model."""

import json

import numpy as np
import pytest
import torch

from helpers import byte_gpt2_config
from shardlm import ShardlmError
from shardlm.inference.genquality import (
    distinct_n,
    generation_quality,
    held_out_prompts,
    last_hidden_features,
    mauve_score,
    repetition_rate,
    rouge_l,
    self_bleu,
    text_metrics,
)
from shardlm.tokenizer import byte_tokenizer

pytest.importorskip("rouge_score")
pytest.importorskip("sacrebleu")
pytest.importorskip("mauve")


def test_distinct_and_repetition_by_hand():
    texts = ["a b a b", "a c"]  # unigrams a b a b a c: 3 unique of 6; bigrams ab ba ab ac: 3 of 4
    assert distinct_n(texts, 1) == 0.5 and distinct_n(texts, 2) == 0.75 and distinct_n(texts, 3) == 1.0
    assert distinct_n(["a"], 2) == 0.0  # no bigram at all
    # rep-2: "a b a b" has bigrams ab ba ab (1 of 3 repeats), "a c" has ac (none): mean of 1/3 and 0
    assert repetition_rate(texts, 2) == pytest.approx(1 / 6)
    assert repetition_rate(["x y z x y z x y"], 4) == pytest.approx(1 - 3 / 5)  # xyzx yzxy zxyz xyzx yzxy
    assert repetition_rate(["too short"], 4) == 0.0


def test_self_bleu_and_rouge_l_by_hand():
    same = "the cat sat on the mat today"
    assert self_bleu([same, same, same]) == pytest.approx(1.0)
    assert self_bleu(["alpha beta gamma delta", "one two three four", "red green blue yellow"]) == 0.0
    assert self_bleu([same]) == 0.0
    # LCS of 5 words: precision 5/5, recall 5/6, F = 2PR/(P+R) = 10/11
    assert rouge_l(["the cat on the mat"], ["the cat sat on the mat"]) == pytest.approx(10 / 11)
    assert rouge_l(["x y", "a b"], ["x y", "c d"]) == pytest.approx(0.5)


def test_mauve_separates_distributions():
    rng = np.random.default_rng(0)
    p = rng.normal(size=(60, 8))
    assert mauve_score(p, p + rng.normal(scale=1e-3, size=p.shape)) > 0.95
    assert mauve_score(p, rng.normal(loc=20.0, size=(60, 8))) < 0.05


def test_text_metrics_keys():
    m = text_metrics(["a b c d e", "a b c d f"], ["a b c d e", "z"])
    assert set(m) == {"distinct_1", "distinct_2", "distinct_3", "rep_4", "self_bleu", "mean_words", "rouge_l"}
    assert m["mean_words"] == 5.0 and m["rouge_l"] == pytest.approx(0.5)


def test_generation_quality_on_a_tiny_model_is_seeded():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(byte_gpt2_config(n_positions=32, n_embd=16, n_head=2)).eval()
    tokens = np.frombuffer(b"To be, or not to be, that is the question. " * 40, dtype=np.uint8).astype(np.int64)
    prompts, truths = held_out_prompts(tokens, 16, 12, 8)
    assert [len(p) for p in prompts] == [8] * 12 and [len(t) for t in truths] == [8] * 12
    assert prompts[0] + truths[0] == tokens[:16].tolist()
    with pytest.raises(ShardlmError, match="--generation 500 needs 500 held-out blocks of 16 tokens.*holds 107"):
        held_out_prompts(tokens, 16, 500, 8)
    features = last_hidden_features(model, [[1, 2, 3], [4, 5]])  # right padding leaves the shorter row as alone
    with torch.no_grad():
        alone = model(torch.tensor([[4, 5]]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert np.allclose(features[1], alone.numpy(), atol=1e-5)
    a = generation_quality(model, byte_tokenizer(), tokens, 16, 12, seed=3)
    assert a == generation_quality(model, byte_tokenizer(), tokens, 16, 12, seed=3)
    assert 0 <= a["mauve"] <= 1 and a["mean_tokens"] == 8 and a["reference"]["distinct_1"] > 0


def test_eval_generation_prints_json_and_appends_to_the_run(tmp_path, capsys):
    """`shardlm eval --generation` end to end on an exported folder; the record a run dir gets is drawn."""
    from transformers import GPT2LMHeadModel

    from shardlm.cli import cmd_eval, parse_args
    from shardlm.inference.evaluate import log_generation
    from shardlm.observe.plot import plot_runs

    torch.manual_seed(0)
    GPT2LMHeadModel(byte_gpt2_config(n_positions=32, n_embd=16, n_head=2)).save_pretrained(tmp_path / "hf")
    byte_tokenizer().save_pretrained(tmp_path / "hf")
    (tmp_path / "val.txt").write_text("To be, or not to be, that is the question. " * 30)
    argv = ["eval", str(tmp_path / "hf"), "--generation", "10", "--seed", "1", f"data.val={tmp_path / 'val.txt'}",
            "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}", "--featurizer", str(tmp_path / "hf")]
    assert cmd_eval(parse_args(argv)) == 0
    out, err = capsys.readouterr()
    gen = json.loads(out)["generation"]
    assert gen["prompts"] == 10 and gen["new_tokens"] == 8 and gen["mauve_features"] == str(tmp_path / "hf")
    assert "MAUVE" in err and "distinct-2" in err and "noisy below" in err
    run = tmp_path / "run"
    (run / "checkpoints" / "step_7").mkdir(parents=True)
    (run / "checkpoints" / "step_7" / "manifest.json").write_text('{"step": 7}')
    (run / "metrics.jsonl").write_text('{"step": 7, "split": "train", "loss": 2.0}\n')
    log_generation(run / "checkpoints" / "step_7", gen)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["split"] == "gen" and record["step"] == 7 and record["mauve"] == gen["mauve"]
    assert run / "plots" / "generation.png" in plot_runs([str(run)])
