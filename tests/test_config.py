import pytest
import yaml

from helpers import ROOT
from shardlm import ShardlmError
from shardlm.config import all_keys, load_config, save_config

PUBLIC_KEYS = [
    "model.name",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.n_positions",
    "model.dropout",
    "model.tokenizer",
    "data.train",
    "data.val",
    "data.seq_len",
    "train.batch_size",
    "train.grad_accum",
    "train.max_steps",
    "train.epochs",
    "train.lr",
    "train.warmup_steps",
    "train.weight_decay",
    "train.grad_clip",
    "train.eval_every",
    "train.eval_batches",
    "train.log_every",
    "train.seed",
    "parallel.sharding",
    "parallel.shard_size",
    "parallel.precision",
    "parallel.cpu_offload",
    "parallel.activation_checkpointing",
    "parallel.compile",
    "out_dir",
]


def test_public_keys_exist():
    assert set(PUBLIC_KEYS) <= set(all_keys())


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 4\n  lr: 0.01\nparallel:\n  sharding: grad_op\n")
    cfg = load_config(path, ["train.batch_size=16", "model.name=null", "checkpoint.async=true"])
    assert cfg.train.batch_size == 16 and cfg.train.lr == 0.01
    assert cfg.parallel.sharding == "grad_op" and cfg.model.name is None and cfg.checkpoint.async_save


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.batchsize=3"], ["train.batchsize", "train.batch_size"]),
        (["trian.lr=1"], ["trian.lr", "train.lr"]),
        (["train.batch_size=abc"], ["train.batch_size", "int", "abc"]),
        (["parallel.sharding=ful"], ["parallel.sharding", "'full'"]),
        (["train.batch_size=0"], ["train.batch_size", "> 0"]),
        (["train.batch_size"], ["key=value"]),
        (["data.seq_len=512", "model.n_positions=256"], ["data.seq_len=512", "n_positions"]),
        (["checkpoint.export_final=true", "checkpoint.save_final=false"], ["export_final", "save_final=true"]),
        (["parallel.compile=modle"], ["parallel.compile", "'model'"]),
        (["parallel.sharding=zero1"], ["parallel.sharding='zero1'", "full, grad_op", "zero3 or FULL_SHARD = full"]),
        (["model.arch=llama", "model.n_kv_head=3"], ["model.n_kv_head=3", "divide model.n_head=4"]),
        (["lora.r=8"], ["lora.r > 0", "model.name is null"]),
        (["model.attention=flash"], ["model.attention='flash'", "flash_attention_2"]),
    ],
)
def test_bad_overrides_name_the_key(overrides, words):
    with pytest.raises(ShardlmError) as err:
        load_config(None, overrides)
    for word in words:
        assert word in str(err.value)


def test_unknown_key_in_yaml_names_file_and_nearest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ShardlmError, match=r"train.learning_rate.*c.yaml. Did you mean 'train.lr'"):
        load_config(path)
    data = tmp_path / "input.txt"  # a corpus given where a config goes
    data.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n")
    with pytest.raises(ShardlmError, match=r"input.txt' is not valid YAML.*looks like data: .*data.train="):
        load_config(data)


@pytest.mark.parametrize("text, words", [
    ("train:\n  lr: [1, 2\n  x: 3\n", ["c.yaml' is not valid YAML: expected ',' or ']', but got ':' at line 3, "
                                       "column 4", "Check the indentation"]),
    ("train:\n\tlr: 1\n", ["c.yaml' is not valid YAML: found character", "at line 2, column 1", "spaces"]),
    ("- a\n- b\n", ["c.yaml' holds a list, not a mapping of sections", "'train:'"]),
    ("just words\n", ["c.yaml' holds a plain string 'just words', not a mapping"]),
    ("train: 5\n", ["'train' in", "c.yaml is a config section", "'train.batch_size'"]),
])
def test_bad_yaml_is_one_line_naming_the_file(tmp_path, text, words):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ShardlmError) as err:
        load_config(tmp_path / "c.yaml")
    assert all(word in str(err.value) for word in words) and "\n" not in str(err.value), str(err.value)


def test_zero_and_fsdp1_sharding_names_resolve_to_shardlm_names(tmp_path):
    aliases = {"zero3": "full", "FULL_SHARD": "full", "ZeRO-2": "grad_op", "shard_grad_op": "grad_op",
               "ddp": "no_shard", "NO_SHARD": "no_shard", "HYBRID_SHARD": "hybrid_full",
               "hybrid_shard_zero2": "hybrid_grad", "Grad_Op": "grad_op"}
    for alias, name in aliases.items():
        assert load_config(None, [f"parallel.sharding={alias}"]).parallel.sharding == name
    (tmp_path / "c.yaml").write_text("train:\nparallel:\n  sharding: ZeRO-3\n")  # an empty section is no error
    save_config(load_config(tmp_path / "c.yaml"), tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["parallel"]["sharding"] == "full"


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.lr=0.5", "parallel.sharding=hybrid_grad", "checkpoint.async=true"])
    save_config(cfg, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["checkpoint"]["async"] is True  # the public name
    assert load_config(tmp_path / "config.yaml").checkpoint.async_save
    again = load_config(
        None,
        [
            f"{s}.{k}={v!r}" if isinstance(v, str) else f"{s}.{k}={v}"
            for s, sec in yaml.safe_load((tmp_path / "config.yaml").read_text()).items()
            if isinstance(sec, dict)
            for k, v in sec.items()
            if v is not None
        ],
    )
    assert again.train.lr == 0.5 and again.parallel.sharding == "hybrid_grad"


def test_fsdp_false_cannot_hold_several_ranks():
    import torch

    from shardlm.distributed.parallelize import plan

    with pytest.raises(ShardlmError, match="parallel.fsdp=false cannot run 2 ranks"):
        plan(load_config(None, ["parallel.fsdp=false"]), 2, 2, torch.device("cpu"))
    assert plan(load_config(None, ["parallel.fsdp=true"]), 1, 1, torch.device("cpu")).use_fsdp


def test_a_bundled_config_by_name_and_a_local_file_first(tmp_path, monkeypatch):
    from shardlm.config import BUNDLED_CONFIGS, config_path

    monkeypatch.chdir(tmp_path)
    bundled = BUNDLED_CONFIGS / "shakespeare_tiny.yaml"
    assert config_path("shakespeare_tiny") == config_path("shakespeare_tiny.yaml") == bundled
    assert load_config("shakespeare_tiny") == load_config(bundled)
    (tmp_path / "shakespeare_tiny.yaml").write_text("out_dir: runs/mine\n")  # a file of that name wins
    assert load_config("shakespeare_tiny.yaml").out_dir == "runs/mine"


def test_shardlm_configs_lists_each_bundled_config_in_one_line(capsys):
    from shardlm.cli import main
    from shardlm.config import bundled_configs

    with pytest.raises(SystemExit) as done:
        main(["configs"])
    lines = capsys.readouterr().out.splitlines()
    assert done.value.code == 0 and [line.split()[0] for line in lines] == list(bundled_configs())
    first = {name: path.read_text().splitlines()[0].removeprefix("# ") for name, path in bundled_configs().items()}
    assert all(line.endswith(first[line.split()[0]]) and line[-1] in ".)" for line in lines), lines


# Hub datasets that are loading scripts, which datasets >= 4 refuses ("Dataset scripts are no longer supported")
SCRIPT_DATASETS = {"Skylion007/openwebtext", "openwebtext", "bookcorpus", "the_pile", "EleutherAI/pile"}


def test_bundled_configs_load_and_name_hub_datasets_current_datasets_reads():
    """Every bundled config loads; each `hf:` source parses as REPO[/CONFIG][:SPLIT] with a repository id of
    the Parquet era (OWNER/NAME, or a canonical name datasets redirects), never a loading-script dataset."""
    from shardlm.config import bundled_configs
    from shardlm.data.sources import parse_hf

    specs = []
    for name in bundled_configs():
        data = load_config(name).data
        specs += [s for s in (data.train if isinstance(data.train, list) else [data.train]) + [data.val]
                  if isinstance(s, str) and s.startswith("hf:")]
    assert specs  # the check checks something
    for spec in specs:
        repo, _, split = parse_hf(spec, "train")
        assert repo not in SCRIPT_DATASETS and split in ("train", "validation", "test"), spec
        assert repo.count("/") == 1 or repo == "wikitext", spec  # wikitext redirects to Salesforce/wikitext


def test_lora_target_modules_all_linear_is_the_default_and_a_bare_name_is_refused():
    assert load_config(None, ["lora.target_modules=all-linear"]).lora.target_modules is None  # PEFT's keyword
    with pytest.raises(ShardlmError, match=r"lora.target_modules='q_proj': give a list .*\[q_proj,v_proj\]"):
        load_config(None, ["lora.target_modules=q_proj"])


def test_a_pretrained_model_gets_fine_tuning_defaults_unless_given(tmp_path):
    """From scratch: lr 3e-3, 2 epochs, warmup 20, decay 0.1; model.name set: HF Trainer's defaults (LoRA: 2e-4);
    a value given in any file or override wins, and the run header's note lists only the defaults in effect."""
    from shardlm.config import task_defaults_note

    def train(cfg):
        return cfg.train.lr, cfg.train.epochs, cfg.train.warmup_steps, cfg.train.weight_decay

    scratch = load_config(None, [])
    assert train(scratch) == (3e-3, 2.0, 20, 0.1) and task_defaults_note(scratch) is None
    full = load_config(None, ["model.name=./mymodel"])
    assert train(full) == (5e-5, 3.0, 0, 0.0)
    assert task_defaults_note(full) == ("fine-tuning defaults (model.name is a pretrained model): train.lr=5e-05, "
                                        "train.epochs=3, train.warmup_steps=0, train.weight_decay=0; "
                                        "set any to override")
    steps = load_config(None, ["model.name=./mymodel", "train.max_steps=10"])  # then epochs set nothing: unnamed
    assert task_defaults_note(steps) == ("fine-tuning defaults (model.name is a pretrained model): train.lr=5e-05, "
                                         "train.warmup_steps=0, train.weight_decay=0; set any to override")
    assert load_config(None, ["model.name=./mymodel", "lora.r=8"]).train.lr == 2e-4
    (tmp_path / "c.yaml").write_text("model:\n  name: ./mymodel\ntrain:\n  lr: 1.0e-3\n  warmup_steps: 20\n")
    mine = load_config(tmp_path / "c.yaml", ["lora.r=8", "train.weight_decay=0.1"])
    assert train(mine) == (1e-3, 3.0, 20, 0.1)
    assert task_defaults_note(mine).endswith("with LoRA): train.epochs=3; set any to override")
    given = load_config(None, ["model.name=./m", "train.lr=1", "train.epochs=1", "train.warmup_steps=1",
                               "train.weight_decay=1"])
    assert train(given) == (1, 1, 1, 1) and task_defaults_note(given) is None
    assert train(load_config(tmp_path / "c.yaml", ["model.name=null"])) == (1e-3, 2.0, 20, 0.1)  # scratch again


@pytest.mark.parametrize("key, suggestion", [
    ("lr", "Did you mean 'train.lr'?"),  # not lora.r, the closer spelling
    ("batch_size", "Did you mean 'train.batch_size'?"),
    ("seq_len", "Did you mean 'data.seq_len'?"),
    ("model.lr", "Did you mean 'train.lr'?"),
    ("dropout", "Did you mean 'model.dropout' or 'lora.dropout'?"),
])
def test_a_bare_key_suggests_the_key_with_that_name(key, suggestion):
    with pytest.raises(ShardlmError) as err:
        load_config(None, [f"{key}=1e-4"])
    assert str(err.value) == f"unknown config key '{key}' in the command line. {suggestion}"


def test_a_run_saved_before_answer_end_keeps_the_masks_it_trained_with(tmp_path):
    """A chat run saved before data.answer_end existed trained to the end-of-turn token: resuming, evaluating or
    exporting it must not switch it to the new default (its cache, validation loss and DPO reference would
    change); a user's own config without the key, and a run saved since, get what they say."""
    from shardlm.checkpoint.layout import read_config

    old = ROOT / "tests" / "data" / "main-edda001" / "run"
    assert "answer_end" not in (old / "config.yaml").read_text()
    assert load_config(old / "config.yaml").data.answer_end == "end_of_turn"
    assert read_config(old).data.answer_end == "end_of_turn"
    (tmp_path / "mine.yaml").write_text("data: {train: x.jsonl, seq_len: 64}\n")
    assert load_config(tmp_path / "mine.yaml").data.answer_end == "template"
    save_config(load_config(tmp_path / "mine.yaml"), tmp_path / "config.yaml")
    assert read_config(tmp_path).data.answer_end == "template"


def test_an_example_run_resumes_with_the_masks_it_trained_with(tmp_path):
    """Resumed from a config of one's own, an old chat run (no data.answer_end saved: it trained end_of_turn) is
    refused in one line naming the key, instead of training other tokens from the next step on."""
    import shutil

    from shardlm.training.checks import check_resumed_masks

    ckpt = tmp_path / "step_000000004"
    ckpt.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "main-edda001" / "run" / "config.yaml", ckpt / "config.yaml")
    with pytest.raises(ShardlmError, match="data.answer_end=end_of_turn, and this run asks for data.answer_end="
                                           "template.*resume with data.answer_end=end_of_turn"):
        check_resumed_masks(load_config(overrides=["data.train=chat.jsonl"]), ckpt)
    check_resumed_masks(load_config(overrides=["data.train=chat.jsonl", "data.answer_end=end_of_turn"]), ckpt)
