"""Bad input: one clear message naming the problem and the fix, exit code 2, no traceback, nothing lost.
The catalogue lives in docs/errors.md; data and config cases are also in test_data.py / test_config.py."""


import pytest
import torch

from conftest import byte_gpt2_config, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.metrics import Eta
from shardlm.model import model_config
from shardlm.parallel import plan
from shardlm.tokenizer import byte_tokenizer, load_tokenizer

CPU = torch.device("cpu")


@pytest.mark.parametrize("overrides, world, local, message", [
    (["parallel.precision=fp16"], 1, 1, "fp16 needs a GPU"),
    (["parallel.sharding=hybrid_full", "parallel.shard_size=2"], 3, 3, "2 does not divide 3 ranks"),
    (["parallel.sharding=hybrid_grad"], 6, 4, "4 does not divide 6 ranks"),
])
def test_infeasible_parallel_plans(overrides, world, local, message):
    with pytest.raises(ShardlmError, match=message):
        plan(load_config(None, overrides), world, local, CPU)


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


@pytest.mark.parametrize("extra, message", [
    ({"train.batch_size": 100000}, "fewer than one global batch"),
    ({"parallel.precision": "fp16"}, "fp16 needs a GPU"),
    ({"data.train": "/nonexistent/corpus.txt"}, "does not exist"),
    ({"train.lr": "fast"}, "train.lr' expects float"),
])
def test_cli_errors_are_one_line_exit_2(corpus, cache_dir, tmp_path, extra, message):
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "run", **extra)], check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:")
    assert not (tmp_path / "run").exists()  # a failed command leaves no empty run folder behind


def test_a_failed_rank_under_nproc_is_one_line(corpus, cache_dir, tmp_path):
    """`shardlm train --nproc 2` with bad input: the rank's one-line error, not torchrun's failure report."""
    args = tiny(corpus, cache_dir, tmp_path / "run", **{"data.train": "/missing.txt"})
    proc = shardlm_cli(["train", "--nproc", "2", *args], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: data path '/missing.txt' does not exist")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["bad.yaml"], "error: config file 'bad.yaml' is not valid YAML: expected ',' or ']', but got ':' at line 3"),
    (["data.train=tiny.txt", "data.seq_len=512", "model.n_positions=256"],  # and a 2-byte corpus
     "error: data.seq_len=512 exceeds model.n_positions=256: lower data.seq_len or raise model.n_positions."),
])
def test_config_errors_come_first_in_one_line(tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("train:\n  lr: [1, 2\n  x: 3\n")
    (tmp_path / "tiny.txt").write_text("hi")
    proc = shardlm_cli(["train", *args, "out_dir=run", "data.cache_dir=cache"], check=False, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(message) and "\n" not in proc.stderr.strip()
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # nothing read or written


def test_out_dir_that_is_a_file(corpus, cache_dir, tmp_path):
    (tmp_path / "file").write_text("precious")
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "file")], check=False)
    assert proc.returncode == 2 and "is a file" in proc.stderr
    assert (tmp_path / "file").read_text() == "precious"


def test_failed_or_finished_commands_leave_a_run_folder_as_it_was(corpus, cache_dir, tmp_path):
    """A bad resume, a missing data path and a resume past the last step change no byte of the run; a
    resume with a changed config keeps the earlier config and counts this invocation's steps apart."""
    shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 2})])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"model.n_layer": 3})], check=False)
    assert proc.returncode == 2 and "n_layer: checkpoint 2 vs config 3" in proc.stderr
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"data.train": "/missing.txt"})], check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 2})])
    assert "nothing to train" in proc.stdout and "raise train.max_steps" in proc.stdout
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.max_steps": 3})])
    assert "train.max_steps 2 -> 3" in proc.stdout and "done: step 3/3; this invocation: 1 step in" in proc.stdout
    assert (tmp_path / "config.1.yaml").read_bytes() == before[tmp_path / "config.yaml"]


def test_disk_full_while_saving_keeps_earlier_checkpoints(corpus, cache_dir, tmp_path, monkeypatch):
    from shardlm import checkpoint as ckpt_mod
    from shardlm.train import train

    cfg = load_config(None, tiny(corpus, cache_dir, tmp_path, **{"checkpoint.every": 2, "train.max_steps": 6}))
    real_save, calls = ckpt_mod.dcp.save, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod.dcp, "save", full_disk)
    with pytest.raises(ShardlmError, match="No space left on device.*intact"):
        train(cfg)
    assert (tmp_path / "checkpoints" / "step_000000002" / "manifest.json").is_file()


def test_eta_lands_within_15_percent_with_warmup_evals_and_saves():
    """Synthetic run: 3 slow warm-up steps (compile), then 0.2 s steps, 1 s evals every 10, 0.5 s saves."""
    total, eta = 100, Eta(100)
    durations = [5.0, 3.0, 2.0] + [0.2] * 97
    for step in range(1, total + 1):
        eta.add_step(durations[step - 1])
        if step % 10 == 0:
            eta.add_eval(1.0)
            eta.add_save(0.5)
        if step >= 5:
            evals_left, saves_left = (total - step) // 10 + 1, (total - step) // 10
            truth = sum(durations[step:]) + evals_left * 1.0 + saves_left * 0.5
            if step >= 10:  # once an eval and a save have been seen
                assert eta.remaining(step, evals_left, saves_left) == pytest.approx(truth, rel=0.15)


@pytest.fixture
def hf_folder(tmp_path):
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "hf"
    GPT2LMHeadModel(byte_gpt2_config(n_positions=32)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_export_never_replaces_a_file_or_a_foreign_folder(hf_folder, tmp_path):
    from shardlm.export import export

    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(ShardlmError, match="is a file; give a folder"):
        export(hf_folder, tmp_path / "notes.txt")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(ShardlmError, match="holds other files .not an earlier export"):
        export(hf_folder, tmp_path / "home")
    assert (tmp_path / "notes.txt").read_text() == (tmp_path / "home" / "thesis.tex").read_text() == "precious"
    export(hf_folder, tmp_path / "out")
    export(hf_folder, tmp_path / "out")  # an earlier export is replaced
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_eval_of_an_export_needs_data(hf_folder):
    from shardlm.evaluate import evaluate_path

    with pytest.raises(ShardlmError, match="carries no data settings: pass data.val=PATH"):
        evaluate_path(str(hf_folder), [])
