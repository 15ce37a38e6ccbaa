"""`shardlm train --dry-run` fails where the run would fail before its first step, with the run's message, and
writes nothing."""

import json
import signal

import pytest

from helpers import refusal as run_refusal
from helpers import tiny, train_in_process
from shardlm import ShardlmError
from shardlm.config import load_config


def test_dry_run_fails_where_the_run_fails_validation_shorter_than_a_block(tmp_path, monkeypatch, capsys):
    """`--dry-run` said "the config is valid" for data whose held-out tail is shorter than one block. Both print the
    run's one line and exit 2 (the CLI in this process: nothing here starts a process group)."""
    from shardlm.cli import main

    def cli(argv: list[str]) -> tuple[int, str]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        return e.value.code, capsys.readouterr().err.strip().splitlines()[-1]

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pc.txt").write_text("x" * 900)  # 901 tokens with EOS: a 91-token tail, under 128 + 1
    args = ["train", "data.train=pc.txt", "train.batch_size=2", "out_dir=run", "data.cache_dir=cache"]
    message = ("error: the validation data (the last 10% of 'pc.txt') has 91 tokens, fewer than one block of "
               "data.seq_len=128 + 1. Use more data or a smaller data.seq_len, or a larger data.val_fraction.")
    assert cli([*args, "--dry-run"]) == (2, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pc.txt"]  # nothing written
    assert cli(args) == (2, message)


@pytest.mark.parametrize("extra, message", [
    ({"train.batch_size": 100000}, "fewer than one global batch"),
    ({"train.gen_every": 2, "train.gen_samples": 100000}, "train.gen_samples 100000 needs 100000 held-out blocks"),
    ({"out_dir": "file/run"}, "cannot create out_dir 'file/run': '.*file' is a file"),
])
def test_dry_run_makes_the_checks_of_build(corpus, cache_dir, tmp_path, monkeypatch, extra, message):
    from shardlm.preflight.dryrun import dry_run

    if "train.gen_every" in extra:
        pytest.importorskip("mauve")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    args = tiny(corpus, cache_dir, tmp_path / "run", **{k: v for k, v in extra.items() if k != "out_dir"})
    with pytest.raises(ShardlmError, match=message):
        dry_run(load_config(None, [*args, f"out_dir={extra.get('out_dir', tmp_path / 'run')}"]), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_dry_run_of_a_finished_run_says_it_would_train_nothing(finished_runs, capsys):
    """The run itself says "nothing to train" when its checkpoint is at the config's last step; so does the dry
    run, instead of reporting the steps it would not train."""
    run = finished_runs[0]["precomputed"]
    assert refusal(["resume", str(run), "train.max_steps=3", "--dry-run"]) == ""  # later wins
    assert "nothing to train" not in capsys.readouterr().out
    assert refusal(["resume", str(run), "--dry-run"]) == ""
    assert "nothing to train: the checkpoint is step 2 and this config ends at step 2" in capsys.readouterr().out


# ---- the errors catalogue (docs/errors.md) through both: `shardlm train` and `shardlm train --dry-run` ----------
# Every refusal of `shardlm train` that needs no training, by its row; the resumes of a trained run further down.
# Left out, and why: 20, 25, 101, 104, 105 (a GPU, root, torch_xla, bitsandbytes); 21 (3 launched ranks); 23, 34,
# 35 (the Hub: a dry run names an unreachable hub model or dataset instead of failing); 7, 52, 114 (argparse and
# override syntax, before either); 27, 28, 30, 51 (while training); 57, 59 (LoRA checkpoints: test_lora); 124, 136,
# 137 (families or templates of their own: test_examples, test_families); the rows of other commands and warnings.
CHAT = [{"role": "user", "content": "Reverse: ab"}, {"role": "assistant", "content": "ba"}]


def _jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _pairs(n: int = 40) -> str:
    return _jsonl(*({"prompt": [CHAT[0]], "chosen": [CHAT[1]], "rejected": [{"role": "assistant", "content": f"a{i}"}]}
                    for i in range(n)))


FILES = {  # name -> contents, written into the case's folder
    "empty.txt": "", "nul.txt": b"ab\x00cd", "a.csv": "title,body\nx,y\n", "bad.jsonl": '{"text": "a"}\n{"text": \n',
    "body.jsonl": _jsonl({"body": "x"}), "a.pdf": "x", "str.jsonl": _jsonl('"text"'), "num.jsonl": _jsonl({"text": 5}),
    "u16.txt": "\ufeffhello".encode("utf-16"), "head.csv": "text\n", "short.txt": "x" * 10,
    "chat.jsonl": _jsonl(*[{"messages": CHAT}] * 60), "chatbad.jsonl": _jsonl({"messages": CHAT}, "{bad"),
    "mesages.jsonl": _jsonl({"mesages": CHAT}), "nomsg.jsonl": _jsonl({"messages": []}),
    "mixed.jsonl": _jsonl({"messages": CHAT}, {"prompt": "a", "completion": "b"}),
    "long.jsonl": _jsonl({"messages": [CHAT[0], {"role": "assistant", "content": "x" * 200}]}),
    "pairs.jsonl": _pairs(), "oneside.jsonl": _jsonl({"prompt": "a", "chosen": "b"}), "more.txt": "To be. " * 3000,
    "bad.yaml": "train:\n  lr: [1,\n  x: 2\n", "list.yaml": "- a\n- b\n", "section.yaml": "train: 5\n",
    "key.yaml": "train:\n  lrr: 1\n", "norun/notes.txt": "no checkpoint here",
}

CATALOGUE = {  # row: overrides (FILE: a file of FILES; HF / OPT: the tiny model folders below)
    "1": ["train.batchsize=8"], "2": ["trian.lr=1"], "3": ["FILE:key.yaml"], "4": ["train.batch_size=abc"],
    "5": ["parallel.sharding=ful"], "6": ["train.batch_size=0"], "8": ["data.seq_len=512", "model.n_positions=256"],
    "37": ["checkpoint.export_final=true", "checkpoint.save_final=false"], "41": ["FILE:bad.yaml"],
    "42": ["FILE:list.yaml"], "43": ["FILE:section.yaml"], "55": ["lora.r=4"], "65": ["--callback=nosuch:X"],
    "92": ["shakespear"], "95": ["data.train=[CORPUS,CORPUS]", "data.weights=[1,2,3]"],
    "96": ["data.train=[CORPUS,CORPUS]", "data.weights=[1,-0.5]"], "97": ["data.train=[CORPUS,CORPUS]",
                                                                           "data.weights=[0,0]"],
    "98": ["data.weights=[1]"], "110": ["lr=1e-4"], "116": ["checkpoint.resume=FILE:norun"],
    "130": ["data.format=chats"], "156": ["preference.reference=livee"],
    "157": ["train.objective=simpo", "preference.rpo_alpha=0.5"],
    "165": ["parallel.activation_checkpointing=selectve"], "165-every0": ["parallel.activation_checkpointing=every:0"],
    "165-blocks": ["parallel.activation_checkpointing=every:3"], "166": ["parallel.wrap=sized:10"],
    "10": ["data.train=FILE:nope.txt"], "11": ["data.train=FILE:empty.txt"], "12": ["data.train=FILE:nul.txt"],
    "14": ["data.train=FILE:a.csv"], "15": ["data.train=FILE:bad.jsonl"], "16": ["data.train=FILE:body.jsonl"],
    "17": ["data.train=FILE:a.pdf"], "18": ["train.batch_size=100000"], "19": ["parallel.precision=fp16"],
    "24": ["out_dir=FILE:short.txt"], "29": ["parallel.launcher=mpi"], "38": ["parallel.precision=fp8"],
    "39": ["parallel.fsdp=false", "parallel.cpu_offload=true"], "45": ["data.train=FILE:str.jsonl"],
    "46": ["data.train=FILE:num.jsonl"], "47": ["data.train=FILE:u16.txt"], "48": ["data.train=FILE:head.csv"],
    "49": ["data.train=FILE:short.txt"], "74": ["data.train=hf:json"], "99": ["data.train=[CORPUS,FILE:short.txt]"],
    "106": ["model.attention=flex_attention"], "109": ["model.name=./mymodle"],
    "115": ["checkpoint.resume=FILE:missing"], "118": ["data.train=FILE:chatbad.jsonl", "model.chat_template=chatml"],
    "119": ["data.train=FILE:mesages.jsonl", "data.format=chat"],
    "120": ["data.train=FILE:nomsg.jsonl", "data.format=chat"],
    "121": ["data.train=FILE:mixed.jsonl", "model.chat_template=chatml"],
    "123": ["data.train=FILE:chat.jsonl"],
    "125": ["data.train=FILE:long.jsonl", "model.chat_template=chatml", "data.truncation=error"],
    "126": ["data.train=FILE:short.txt", "data.format=chat"],
    "127": ["model.name=OPT", "data.train=FILE:chat.jsonl", "model.chat_template=chatml", "data.seq_len=32"],
    "128": ["data.train=FILE:chat.jsonl", "model.chat_template=chatml", "train.gen_every=1"],
    "128-mixture": ["data.train=[CORPUS,FILE:more.txt]", "train.gen_every=1"],
    "132": ["data.train=FILE:oneside.jsonl", "data.format=preference"],
    "133-sft": ["data.train=FILE:pairs.jsonl", "model.chat_template=chatml", "data.seq_len=64"],
    "133-dpo": ["train.objective=dpo"],
    "9": ["model.name=HF", "data.seq_len=64"], "22": ["model.name=HF", "model.tokenizer=gpt2"],
    "54": ["model.name=HF", "lora.r=2", "lora.target_modules=[qkv]"],
    "58": ["model.name=HF", "lora.r=2", "lora.quantize=nf4", "lora.quant_backend=bitsandbytes"],
    "131": ["model.name=HF", "data.train=FILE:chat.jsonl", "model.chat_template=chatml", "data.seq_len=32"],
    "138": ["model.name=HF", 'model.config_overrides={"n_inner": 64}'],
    "139": ["model.name=HF", "model.rope_scaling={type: yarn, factor: 4}"],
    "148": ["train.optimizer=adamw_8bti"], "149": ["train.muon_lr=0.01"],
    "151": ["train.schedule=linear", "train.warmup_steps=50"],
    "113-gen": ["train.gen_every=2", "train.gen_samples=100000"],
}


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """HF: a 1-layer byte-level GPT-2 folder with 32 positions; OPT: an OPT folder (packing refused for it)."""
    import torch
    from transformers import GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    from helpers import byte_gpt2_config, save_hf_folder

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(vocab_size=259, hidden_size=8, num_hidden_layers=1, ffn_dim=16,
                                   num_attention_heads=1, max_position_embeddings=64, word_embed_proj_dim=8,
                                   bos_token_id=256, eos_token_id=256, pad_token_id=256))
    return {"HF": save_hf_folder(GPT2LMHeadModel(byte_gpt2_config(n_positions=32)), root / "hf"),
            "OPT": save_hf_folder(opt, root / "opt")}


def refusal(argv: list[str]) -> str:
    """The message `shardlm ARGV` refuses with, run in this process (ShardlmError's text: the CLI prints it as
    `error: ...` and exits 2); '' if it ran."""
    import torch

    try:
        return run_refusal(argv)
    finally:
        assert not torch.distributed.is_initialized()  # no case starts a process group (the CLI would exit)


@pytest.mark.parametrize("row", list(CATALOGUE))
def test_every_refusal_is_the_same_in_the_run_and_its_dry_run(row, corpus, tmp_path, model_folders, monkeypatch):
    """`--dry-run` makes the run's checks (one list, shardlm.training.checks): what `shardlm train` refuses before
    its first step, the dry run refuses with the same message, and writes nothing."""
    if row.startswith(("113", "128")):
        pytest.importorskip("mauve")
    monkeypatch.chdir(tmp_path)
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())

    def resolved(value: str) -> str:
        value = value.replace("CORPUS", str(corpus))
        for name, folder in model_folders.items():
            value = value.replace(f"={name}", f"={folder}")
        return value.replace("FILE:", f"{tmp_path}/")

    args = ["train", *tiny(corpus, tmp_path / "cache", tmp_path / "run", **{"train.max_steps": 2}),
            *map(resolved, CATALOGUE[row])]
    before = sorted(p.name for p in tmp_path.iterdir())
    dry = refusal([*args, "--dry-run"])
    assert dry and sorted(p.name for p in tmp_path.iterdir()) == before  # refused, nothing written
    assert refusal(args) == dry


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory):
    """Two-step DPO runs on pairs with their final checkpoint, the reference precomputed and live; a cache of their
    own (a test takes the stored reference away)."""
    root = tmp_path_factory.mktemp("finished")
    (root / "pairs.jsonl").write_text(_pairs(60))
    runs = {}
    for mode in ("precomputed", "live"):
        runs[mode] = tiny(root / "pairs.jsonl", root / "cache", root / mode, **{
            "train.max_steps": 2, "train.batch_size": 4, "data.seq_len": 64, "model.chat_template": "chatml",
            "train.objective": "dpo", "preference.reference": mode})
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # an in-process run sets its own
    try:
        for args in runs.values():
            train_in_process(args)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return {name: root / name for name in runs}, root / "cache"


@pytest.mark.parametrize("row, run, extra", [
    ("26", "precomputed", ["model.n_layer=3"]),  # another architecture
    ("152", "precomputed", ["train.optimizer=sgd"]),  # another optimizer's state
    ("135", "precomputed", []),  # the stored reference is gone
    ("156", "live", ["train.seed=7"]),  # a live reference would rebuild another initial model
])
def test_a_refused_resume_is_refused_by_its_dry_run_too_and_leaves_the_run_as_it_was(row, run, extra, finished_runs):
    """`shardlm resume` refused for the checkpoint it would resume writes nothing: not config.yaml (it rewrote it,
    max_steps changed, the old one moved to config.1.yaml), not an event file; and `--dry-run` says the same."""
    from helpers import folder_digest

    runs, cache = finished_runs
    folder = runs[run]
    refs = list(cache.glob("ex-*/reference-*.npy")) if row == "135" else []
    for ref in refs:
        ref.rename(ref.with_suffix(".away"))
    try:
        digest = folder_digest(folder)
        args = ["resume", str(folder), "train.max_steps=4", *extra]
        dry = refusal([*args, "--dry-run"])
        assert dry and refusal(args) == dry, row
        assert folder_digest(folder) == digest
    finally:
        for ref in refs:
            ref.with_suffix(".away").rename(ref)


def test_a_warmup_longer_than_the_run_is_said_by_the_run_and_its_dry_run(corpus, tmp_path, capsys):
    """docs/chat.md's own `train.max_steps=10` with the default 20 warmup steps ended at half the peak rate, unsaid."""
    from shardlm.preflight.dryrun import dry_run
    from shardlm.training.build import build

    warning = ("warning: train.warmup_steps=20 is longer than the run's 10 steps: the learning rate ends its warmup "
               "at 0.5 x train.lr and never reaches it. Set train.warmup_steps below 10 to train at train.lr.")
    cfg = load_config(None, tiny(corpus, tmp_path / "cache", tmp_path / "run", **{"train.warmup_steps": 20}))
    assert warning in dry_run(cfg, 1).splitlines()
    run = build(cfg)
    assert warning in capsys.readouterr().out.splitlines()
    assert run.scheduler.lr_lambdas[0](run.total_steps - 1) == 0.5  # what it says
    short = load_config(None, tiny(corpus, tmp_path / "cache", tmp_path / "run", **{"train.warmup_steps": 5}))
    assert "warning" not in dry_run(short, 1)
