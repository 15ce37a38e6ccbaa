"""`shardlm export`: a trained run's Hugging Face folder that `generate`, `eval` and transformers' pipeline read
alike, and the export never replaces a file, a foreign folder or the model being exported."""

import json

import pytest

from helpers import shardlm_cli, tiny
from shardlm import ShardlmError


def test_export_generate_eval_round_trip(corpus, cache_dir, tmp_path):
    run = tmp_path / "run"
    shardlm_cli(["train", *tiny(corpus, cache_dir, run, **{"train.max_steps": 30, "checkpoint.export_final": True,
                                                                 "model.n_positions": 32, "model.vocab_multiple": 64})],
                nproc=2)  # 257 byte ids padded to 320: the export trims the 63 padding rows
    hf = run / "hf"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (hf / name).is_file(), name
    # what other tools read: llama.cpp's converter needs GPT-2's n_ctx; the real context, not 1024
    config = json.loads((hf / "config.json").read_text())
    assert config["n_ctx"] == 32 and config["vocab_size"] == 257 and "tokenizer_size" not in config
    assert json.loads((hf / "tokenizer_config.json").read_text())["model_max_length"] == 32
    gen = json.loads((hf / "generation_config.json").read_text())  # ids, no sampling defaults for engines to adopt
    assert {k: gen.get(k) for k in ("do_sample", "temperature", "suppress_tokens")} == dict.fromkeys(
        ("do_sample", "temperature", "suppress_tokens"))
    assert gen["max_new_tokens"] == 16  # a 32-position model: half its context, not pipeline's 256
    assert gen["pad_token_id"] == config["pad_token_id"] == config["eos_token_id"] == 256
    prompt = "ROMEO:"
    from_ckpt = shardlm_cli(["generate", str(run), "--prompt", prompt, "--temperature", "0",
                             "--max-new-tokens", "20"]).stdout
    from_export = shardlm_cli(["generate", str(hf), "--prompt", prompt, "--temperature", "0",
                               "--max-new-tokens", "20"]).stdout
    assert from_ckpt == from_export and from_ckpt.startswith(prompt)

    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(hf), device="cpu")
    text = pipe(prompt, max_new_tokens=20, do_sample=False)[0]["generated_text"]
    assert text == from_ckpt.rstrip("\n")

    val = ["data.val=" + str(corpus), "data.seq_len=32", "train.batch_size=4"]
    eval_ckpt = json.loads(shardlm_cli(["eval", str(run), *val]).stdout.splitlines()[-1])
    eval_hf = json.loads(shardlm_cli(["eval", str(hf), *val]).stdout.splitlines()[-1])
    assert eval_ckpt == pytest.approx(eval_hf, rel=1e-6)
    stride = json.loads(shardlm_cli(["eval", str(hf), *val, "--stride", "8"]).stdout.splitlines()[-1])
    assert stride["tokens"] >= eval_hf["tokens"]
    assert stride["loss"] < eval_hf["loss"]  # every token sees >= 24 tokens of context, not 0..31


def test_export_never_replaces_a_file_or_a_foreign_folder(hf_folder, tmp_path):
    from shardlm.inference.export import export

    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(ShardlmError, match="is a file; give a folder"):
        export(hf_folder, tmp_path / "notes.txt")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(ShardlmError, match="holds other files .not an earlier shardlm export"):
        export(hf_folder, tmp_path / "home")
    assert (tmp_path / "notes.txt").read_text() == (tmp_path / "home" / "thesis.tex").read_text() == "precious"
    export(hf_folder, tmp_path / "out")
    export(hf_folder, tmp_path / "out")  # an earlier export is replaced
    assert (tmp_path / "out" / "model.safetensors").is_file()
    with pytest.raises(ShardlmError, match="is the model being exported"):
        export(tmp_path / "out", tmp_path / "out")
    before = sorted(p.name for p in hf_folder.iterdir())
    with pytest.raises(ShardlmError, match="not an earlier shardlm export"):  # e.g. a downloaded model
        export(tmp_path / "out", hf_folder)
    assert sorted(p.name for p in hf_folder.iterdir()) == before
