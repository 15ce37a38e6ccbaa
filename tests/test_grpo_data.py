"""Online RL's prompt data (shardlm.data.prompts): records and chat data as PromptRows, the prompt cache, and the
run's prompt splits (build, its refusals)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.formats import BadExample
from shardlm.data.prompt_cache import build_prompts, load_prompts, prepare_prompts
from shardlm.data.prompts import prompt_rows, prompt_token_ids
from shardlm.data.sources import resolve
from shardlm.tokenizer import byte_tokenizer, set_chat_template

CHAT = [{"messages": [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"}],
         "task": "reverse"},
        {"messages": [{"role": "user", "content": "Upper: ab"}, {"role": "assistant", "content": "AB"}],
         "task": "upper", "extra": 1}]


@pytest.fixture(scope="module")
def tok():
    t = byte_tokenizer()
    set_chat_template(t, "chatml")
    return t


def test_records_in_memory(tok):
    """Chat data's last answer becomes `answer`; the ids are the rendered prompt's with its generation prompt; the
    fields are those every record holds; a held-out share indexes the same set."""
    rows = prompt_rows(CHAT, tok, DataConfig(), where="mem")
    assert len(rows) == 2 and rows.field_names == ["task", "answer"]
    assert rows.prompt(1).fields == {"answer": "AB", "task": "upper", "extra": 1}
    assert rows.prompt(0).prompt == CHAT[0]["messages"][:1] and rows.where(1) == "mem:2"
    assert rows.token_ids(0) == prompt_token_ids(tok, rows.prompt(0))
    assert rows.max_prompt_tokens == max(len(rows.token_ids(i)) for i in range(2))
    tail = rows.share(1)
    assert len(tail) == 1 and tail.token_ids(0) == rows.token_ids(1) and tail.where(0) == "mem:2"
    with pytest.raises(BadExample, match="mem:2: no 'prompt'"):
        prompt_rows([CHAT[0], {"question": "x"}], tok, DataConfig(), where="mem")
    skipped = prompt_rows([CHAT[0], {"question": "x"}], tok, DataConfig(on_bad_example="skip"), where="mem")
    assert len(skipped) == 1


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def same(a, b) -> bool:
    """The same prompts: ids, fields, the prompt as the rewards see it, and where each came from."""
    return len(a) == len(b) and all(a.token_ids(i) == b.token_ids(i) and a.prompt(i) == b.prompt(i)
                                    and a.where(i) == b.where(i) for i in range(len(a)))


def test_the_cache_renders_once_and_reloads_the_same(tok, tmp_path):
    """Tokenized once (a second build finds it and writes nothing), memory-mapped ids, fields read back from JSON
    as the records held them, equal to the same records in memory; a damaged file is refused in one line."""
    records = [*CHAT, {"prompt": "2+2=", "solution": 4, "task": "add"},
               {"instruction": "Reverse", "input": "xy", "output": "yx", "task": "reverse"}]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    cfg, logs = DataConfig(cache_dir=str(tmp_path / "cache")), []
    folder = build_prompts(resolve(str(path), "train", None), tok, cfg, tmp_path / "cache", log=logs.append)
    assert folder.name.startswith("rl-") and sum("rendering" in line for line in logs) == 1
    assert [line for line in logs if line.startswith("warning")] == [  # the rewards get only the fields all hold
        f"warning: 1 of the 4 prompts of {path} lacks the field 'answer' (the first: {path}:3), so no reward can "
        "use it: add it to every record",
        f"warning: 3 of the 4 prompts of {path} lack the field 'extra' (the first: {path}:1), so no reward can use it: "
        "add it to every record",
        f"warning: 3 of the 4 prompts of {path} lack the field 'solution' (the first: {path}:1), so no reward can use "
        "it: add it to every record"]
    stamp = (folder / "tokens.bin").stat().st_mtime_ns
    again = build_prompts(resolve(str(path), "train", None), tok, cfg, tmp_path / "cache", log=logs.append)
    assert again == folder and (folder / "tokens.bin").stat().st_mtime_ns == stamp
    assert sum("rendering" in line for line in logs) == 1 and not list(folder.glob("*.pkl"))
    rows = load_prompts(folder)
    assert same(rows, prompt_rows(records, tok, cfg, where=str(path)))
    assert rows.field_names == ["task"] and rows.prompt(2).fields == {"solution": 4, "task": "add"}
    assert rows.prompt(3).prompt == [{"role": "user", "content": "Reverse\n\nxy"}]
    assert rows.prompt(3).fields == {"task": "reverse", "answer": "yx"}
    with open(folder / "prompts.jsonl", "r+b") as fh:  # one byte changed in place
        fh.seek(3)
        fh.write(b"X")
    with pytest.raises(ShardlmError, match=r"prompts.jsonl was changed since it was written .* Delete .* and rerun"):
        load_prompts(folder)


def test_chat_tasks_as_prompts(tok):
    """The bundled chat tasks serve as prompts: the last answer is `answer`; without data.val the last
    data.val_fraction is held out (the same cache, another range). `dist` None writes nothing (a dry run)."""
    train, val = prepare_prompts(DataConfig(train="chat_tasks_heldout", val_fraction=0.25), tok, None)
    lines = resolve("chat_tasks_heldout", "train", None).files[0].read_text().splitlines()
    first, held = json.loads(lines[0]), json.loads(lines[150])
    assert (len(train), len(val)) == (150, 50) and train.field_names == val.field_names == ["answer"]
    assert train.prompt(0).prompt == first["messages"][:-1]
    assert train.prompt(0).fields["answer"] == first["messages"][-1]["content"]
    assert val.where(0).endswith("heldout.jsonl:151") and val.prompt(0).fields["answer"] == \
        held["messages"][-1]["content"]
    assert val.token_ids(0) == prompt_token_ids(tok, val.prompt(0))


def test_parquet_and_hf_prompts(tok, tmp_path):
    """Parquet (rows named `file:row N`) and `hf:json` records give the prompts JSONL gives."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    records = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+4=", "answer": "7"}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    jsonl = write_jsonl(tmp_path / "p.jsonl", records)
    cfg = DataConfig(data_files=str(jsonl))
    got = [load_prompts(build_prompts(resolve(spec, "train", cfg.data_files), tok, cfg, tmp_path / "cache",
                                      log=lambda _: None)) for spec in (str(jsonl), str(tmp_path / "p.parquet"),
                                                                        "hf:json")]
    assert [got[0].token_ids(i) for i in range(2)] == [list(b"2+2="), list(b"3+4=")]
    for rows in got:
        assert [(rows.token_ids(i), rows.prompt(i)) for i in range(2)] == \
            [(got[0].token_ids(i), got[0].prompt(i)) for i in range(2)]
    assert got[1].where(1).endswith("p.parquet:row 2") and got[1].prompt(1).fields == {"answer": "7"}


def test_online_rl_takes_trls_defaults():
    """A pretrained model under grpo/rloo takes TRL's learning rate (1e-6, LoRA or not); rloo takes RLOOConfig's
    group and beta even from scratch, before the checks (batch 6 fits group 2, not grpo's 8); given keys win."""
    from shardlm.config import load_config, task_defaults_note

    room = ["grpo.max_completion_length=64"]
    rloo = load_config(None, [*room, "train.objective=rloo", "train.batch_size=6"])
    assert (rloo.grpo.group, rloo.grpo.beta, rloo.train.lr) == (2, 0.05, 3e-3)
    assert task_defaults_note(rloo) == ("train.objective=rloo defaults (TRL's RLOOConfig): grpo.group=2, "
                                        "grpo.beta=0.05, data.seq_len=1024; set any to override")
    grpo = load_config(None, [*room, "train.objective=grpo", "model.name=./m", "lora.r=8", "train.batch_size=8"])
    assert (grpo.grpo.group, grpo.grpo.beta, grpo.train.lr, grpo.train.warmup_steps) == (8, 0.0, 1e-6, 0)
    assert "train.objective=grpo takes TRL's GRPOConfig's): train.lr=1e-06" in task_defaults_note(grpo)
    given = load_config(None, [*room, "train.objective=rloo", "model.name=./m", "grpo.group=4", "train.lr=1e-5"])
    assert (given.grpo.group, given.grpo.beta, given.train.lr) == (4, 0.05, 1e-5)
    with pytest.raises(ShardlmError, match="train.batch_size=6 counts completions"):
        load_config(None, [*room, "train.objective=grpo", "train.batch_size=6"])


def train_cli(argv: list[str], capsys) -> tuple[int, str]:
    """`shardlm train ARGV` in this process (its refusals come before any process group): exit code, last line."""
    from shardlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    return e.value.code, capsys.readouterr().err.strip().splitlines()[-1]


RL_RUN = ["model.tokenizer=bytes", "model.chat_template=chatml", "model.n_layer=1", "model.n_embd=16",
          "model.n_head=1", "model.n_positions=64", "data.seq_len=48", "train.objective=grpo", "grpo.group=2",
          "train.batch_size=2", "grpo.max_completion_length=16", "train.max_steps=1", "data.cache_dir=cache",
          "out_dir=run", "parallel.device=cpu", "log.tensorboard=false"]


def test_a_run_refuses_a_prompt_too_long_and_text(tmp_path, monkeypatch, capsys):
    """A prompt longer than data.seq_len - grpo.max_completion_length is refused with its path:line before anything
    is written to the run (an earlier file in out_dir is kept byte for byte); a text corpus, which holds no
    prompts, in one line naming the fix."""
    monkeypatch.chdir(tmp_path)
    chat = [{"messages": [{"role": "user", "content": "Reverse: " + "ab" * n}, {"role": "assistant", "content": "x"}]}
            for n in (1, 2, 20, 1)]
    write_jsonl(tmp_path / "p.jsonl", chat)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_bytes(b"mine\n")
    code, line = train_cli(["data.train=p.jsonl", "data.val=p.jsonl", *RL_RUN], capsys)
    assert code == 2 and line == ("error: p.jsonl:3: the prompt has 68 tokens, more than the 32 that data.seq_len=48 "
                                  "leaves beside grpo.max_completion_length=16: raise data.seq_len, lower "
                                  "grpo.max_completion_length, or shorten the prompt.")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]
    assert (tmp_path / "run" / "notes.txt").read_bytes() == b"mine\n"
    (tmp_path / "corpus.txt").write_text("To be or not to be.\n" * 50)
    code, line = train_cli(["data.train=corpus.txt", *RL_RUN], capsys)
    assert code == 2 and line.startswith("error: data.train='corpus.txt': it is plain text, but online RL "
                                         "(train.objective grpo/rloo) samples completions of prompts: give records")


def test_prepare_renders_the_prompt_cache_a_run_uses(tmp_path, monkeypatch, capsys):
    """`shardlm prepare` of a grpo config builds the prompt cache (not an example cache of the same chat data), the
    one the run then finds built."""
    from shardlm.cli import main

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p.jsonl", CHAT * 3)
    with pytest.raises(SystemExit) as done:
        main(["prepare", "data.train=p.jsonl", *RL_RUN])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "train: p.jsonl: 6 prompts," in out and "training prompts are held out" in out
    built = [p.parent for p in (tmp_path / "cache").glob("*/meta.json")]
    assert len(built) == 1 and built[0].name.startswith("rl-")
    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")
    train, _ = prepare_prompts(DataConfig(train="p.jsonl", cache_dir="cache"), tok, None)
    assert Path(train.meta["folder"]).resolve() == built[0].resolve()  # found, not rendered again
    with pytest.raises(SystemExit) as done:  # a mixture, which the run refuses, is not rendered either
        main(["prepare", "data.train=[p.jsonl,p.jsonl]", *RL_RUN])
    assert done.value.code == 2 and "data.train is a list (a mixture), but online RL" in capsys.readouterr().err


def test_prompt_sources_that_cannot_serve(tok, tmp_path):
    """Each refused in one line naming the fix: a mixture, a record without a prompt, a source with none left, a
    field JSON cannot hold, a conversation without a chat template or one it refuses (skipped on request), a
    held-out share too small to hold one prompt."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "answer": "y"}] * 3)
    with pytest.raises(ShardlmError, match=r"data.train is a list \(a mixture\), but online RL .* concatenate"):
        prepare_prompts(DataConfig(train=[str(a), str(a)]), tok, None)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}, {"question": "q"}])
    with pytest.raises(ShardlmError, match=r"bad.jsonl:2: no 'prompt' \(nor chat 'messages'\) in this record"):
        prepare_prompts(DataConfig(train=str(bad)), tok, None)
    none = write_jsonl(tmp_path / "none.jsonl", [{"question": "q"}])
    with pytest.raises(ShardlmError, match=r"holds no prompts \(all 1 were skipped as bad; the first: .*none.jsonl:1"):
        prepare_prompts(DataConfig(train=str(none), on_bad_example="skip"), tok, None)
    (tmp_path / "obj.jsonl").write_text('{"prompt": "x", "blob": {"a": 1}}\n')  # JSON in, JSON out: fine
    assert prepare_prompts(DataConfig(train=str(tmp_path / "obj.jsonl"), val=str(a)), tok, None)[0].prompt(0).fields \
        == {"blob": {"a": 1}}
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"prompt": ["x"], "image": [b"\x89PNG"]}), tmp_path / "b.parquet")
    with pytest.raises(ShardlmError, match=r"b.parquet:row 1: field 'image' holds a bytes, which the prompt cache "
                                           "cannot store as JSON .* Convert it to text or numbers, or drop the field."):
        prepare_prompts(DataConfig(train=str(tmp_path / "b.parquet"), val=str(a)), tok, None)
    plain = byte_tokenizer()
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "x"}, {"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ShardlmError, match=r"chat.jsonl:2: a conversation needs a chat template and tokenizer .* has "
                                           "none. Set model.chat_template"):
        prepare_prompts(DataConfig(train=str(chat), val=str(a)), plain, None)
    set_chat_template(plain, "plain")
    tool = write_jsonl(tmp_path / "tool.jsonl", [{"prompt": [{"role": "user", "content": "x"}]},
                                                 {"prompt": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ShardlmError, match=r"tool.jsonl:2: the chat template refuses this conversation \(.*\). Fix"):
        prepare_prompts(DataConfig(train=str(tool), val=str(a)), plain, None)
    assert len(prepare_prompts(DataConfig(train=str(tool), val=str(a), on_bad_example="skip"), plain, None)[0]) == 1
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "x"}])
    with pytest.raises(ShardlmError, match=r"the training data '.*one.jsonl' has no prompts with data.val_fraction=0.1 "
                                           r"held out for validation. Use more prompts, data.val, or another"):
        prepare_prompts(DataConfig(train=str(one)), tok, None)
