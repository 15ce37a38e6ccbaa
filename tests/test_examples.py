"""Examples (prompt/completion, chat): formats, chat templates, answer-only masks, packing, the loss's normalization.

The masks are checked against the real public templates in tests/data/chat_templates (Llama 3.1, Qwen2.5, Qwen3,
Gemma 2/3, Mistral v0.3, Phi-3.5, SmolLM2, ChatML) on the GPT-2 tokenizer with each template's special tokens,
against transformers' own `return_assistant_tokens_mask` on TRL's training templates (generation markers), and
against TRL's `SFTTrainer` itself (messages with `assistant_only_loss`, conversational prompt/completion).
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.examples import ExampleSet, build_examples, load_examples
from shardlm.data.formats import to_example
from shardlm.data.packing import ExampleRows, best_fit_decreasing
from shardlm.data.render import TemplateError, tokenize
from shardlm.data.sources import resolve
from shardlm.models.attention import PACKING_FAMILIES, TESTED_FAMILIES
from shardlm.models.hf_config import check_packing
from shardlm.tokenizer import fingerprint, load_tokenizer, set_chat_template, template_fingerprint

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SOURCES = json.loads((TEMPLATES / "sources.json").read_text())
CONVERSATION = [{"role": "user", "content": "Repeat: ab"}, {"role": "assistant", "content": "ab"},
                {"role": "user", "content": "Add 3 and 4."}, {"role": "assistant", "content": "7"}]


def template_tokenizer(name: str):
    """The GPT-2 tokenizer with a real template and its special tokens, as the model's own would be."""
    info = SOURCES[name]
    tok = load_tokenizer("gpt2")
    missing = [t for t in info["special_tokens"] if t not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": missing})
    if info["bos_token"]:
        tok.bos_token = info["bos_token"]
    tok.eos_token = info["eos_token"]
    tok.chat_template = (TEMPLATES / name).read_text()
    return tok


def trained_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_masks_of_real_templates_cover_each_answer_and_its_end_of_turn(name):
    tok, info = template_tokenizer(name), SOURCES[name]
    system = [{"role": "system", "content": "Be brief."}] if info["supports_system"] else []
    messages = system + CONVERSATION
    ids, mask = tokenize(tok, to_example({"messages": messages}, "messages", "x:1"), "x:1")
    assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    eot = info["end_of_turn"]
    text = trained_text(tok, ids, mask).replace(" ", "").replace("\n", "")
    # every answer with the token that ends its turn, nothing of the prompts (Qwen3 adds an empty think block to
    # the last turn, Phi-3.5 its EOS after the last turn: both are what the model must generate)
    want = f"ab{eot}" + ("<think></think>" if name == "qwen3.jinja" else "") + f"7{eot}" \
        + ("<|endoftext|>" if name == "phi3.jinja" else "")
    assert text == want
    assert "Repeat" not in trained_text(tok, ids, mask) and "Be brief" not in trained_text(tok, ids, mask)
    # answer_end=end_of_turn trains the same but the whitespace the template writes after an end of turn
    same, stop = tokenize(tok, to_example({"messages": messages}, "messages", "x:1"), "x:1", answer_end="end_of_turn")
    extra = [i for i, (a, b) in enumerate(zip(mask, stop, strict=True)) if a != b]
    assert same == ids and not (stop > mask).any() and tok.decode([ids[i] for i in extra]).strip() == ""
    assert bool(extra) == (f"{eot}\n" in tok.decode(ids))  # ChatML, Gemma, Phi-3: the newline; Llama, Mistral: none


def trl_template(name: str) -> str:
    """TRL's training copy of a family's template: the stock one with `{% generation %}` around each answer."""
    import importlib.resources

    return (importlib.resources.files("trl") / "chat_templates" / name).read_text()


# ChatML marked to end its answers at <|im_end|>, before the newline: the markers are followed as they stand
CHATML_UNTIL_END = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize(("name", "marked"), [
    ("qwen2_5.jinja", "qwen2_5_training.jinja"), ("llama3.jinja", "llama3_training.jinja"),
    ("gemma2.jinja", "gemma_training.jinja"), ("phi3.jinja", "phi3_training.jinja"), ("chatml.jinja", None)])
def test_mask_equals_transformers_assistant_tokens_mask(name, marked):
    """A template with generation markers (TRL's training copies; ChatML's blocks end after the newline that
    follows <|im_end|>) trains exactly transformers' `return_assistant_tokens_mask`; end_of_turn trains a part of
    it: not the whitespace after an end of turn (nor Qwen2.5's line break after `assistant`)."""
    tok, info = template_tokenizer(name), SOURCES[name]
    tok.chat_template = trl_template(marked) if marked else CHATML_UNTIL_END
    messages = ([{"role": "system", "content": "Be brief."}] if info["supports_system"] else []) + CONVERSATION
    ids, mask = tokenize(tok, to_example({"messages": messages}, "messages", "x:1"), "x:1")
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(ref["input_ids"]) and mask.tolist() == list(ref["assistant_masks"])
    _, stop = tokenize(tok, to_example({"messages": messages}, "messages", "x:1"), "x:1", answer_end="end_of_turn")
    assert (stop <= mask).all() and (stop == mask).all() == (name in ("llama3.jinja", "chatml.jinja"))
    if name == "qwen2_5.jinja":  # the standard ChatML case: the newline after <|im_end|> is the answer's
        assert trained_text(tok, ids, mask) == "\nab<|im_end|>\n\n7<|im_end|>\n"


def test_generation_markers_that_mark_no_answer_are_refused():
    tok = template_tokenizer("chatml.jinja")
    tok.chat_template += "{% if false %}{% generation %}{% endgeneration %}{% endif %}"
    with pytest.raises(ShardlmError, match=r"x:1: the chat template's \{% generation %\} blocks mark no token of this "
                                           r"conversation's answers. Fix the template's markers, or set "
                                           r"data.answer_end=end_of_turn"):
        tokenize(tok, to_example({"messages": CONVERSATION}, "messages", "x:1"), "x:1")
    example = to_example({"messages": CONVERSATION}, "messages", "x:1")
    ids, mask = tokenize(tok, example, "x:1", answer_end="end_of_turn")  # shardlm finds the answers itself
    assert trained_text(tok, ids, mask) == "ab<|im_end|>7<|im_end|>"


def test_trls_sft_trainer_trains_the_same_tokens(tmp_path):
    """TRL's SFTTrainer itself, with its defaults: messages with `assistant_only_loss` on Qwen2.5's template with
    TRL's generation markers, and conversational prompt/completion (completion-only loss) on the stock template,
    give the same ids and targets. The stock template has no markers: TRL swaps in its training copy for the
    families it knows (else refuses), shardlm finds each turn itself and trains the same tokens but the line
    break after `<|im_start|>assistant`, which TRL's copy of Qwen2.5 also marks and the generation prompt always
    gives."""
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import SFTConfig, SFTTrainer

    tok = template_tokenizer("qwen2_5.jinja")
    tok.pad_token = "<|endoftext|>"
    stock = tok.chat_template

    def trl_rows(records: list[dict], template: str, **args) -> list[tuple[list[int], list[int]]]:
        tok.chat_template = template
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=8, num_hidden_layers=1,
                                             num_attention_heads=1, num_key_value_heads=1, intermediate_size=8))
        trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=Dataset.from_list(records),
                             args=SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **args))
        return [(row["input_ids"], [int(x != -100) for x in row["labels"]]) for row in trainer.train_dataset]

    def ours(records: list[dict], variant: str) -> list[tuple[list[int], list[int]]]:
        return [(ids, mask.tolist()) for ids, mask in
                (tokenize(tok, to_example(r, variant, "x"), "x") for r in records)]

    chats = [{"messages": CONVERSATION}, {"messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION]}]
    theirs = trl_rows(chats, trl_template("qwen2_5_training.jinja"), assistant_only_loss=True)  # sets the template
    # TRL's labels leave the first token out whatever it is (nothing predicts it): compare from the second
    assert [(i, m[1:]) for i, m in ours(chats, "messages")] == [(i, m[1:]) for i, m in theirs]
    completions = [{"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]},
                   {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}]
    their_completions = trl_rows(completions, stock)  # TRL's defaults: completion-only loss
    assert [(i, m[1:]) for i, m in ours(completions, "prompt_completion")] == \
        [(i, m[1:]) for i, m in their_completions]
    assert trained_text(tok, *ours(completions, "prompt_completion")[0]) == "ab<|im_end|>\n"
    tok.chat_template = stock
    (ids, mask), (their_ids, their_mask) = ours(chats, "messages")[0], theirs[0]
    assert ids == their_ids
    differ = [k for k, (a, b) in enumerate(zip(mask, their_mask, strict=True)) if a != b]
    assert len(differ) == 2 and all(their_mask[k] and tok.decode(ids[:k + 1]).endswith("<|im_start|>assistant\n")
                                    for k in differ)


def test_completion_mask_is_trls_rule_and_conversational_prompts_use_the_generation_prompt():
    tok = load_tokenizer("gpt2")
    ids, mask = tokenize(tok, to_example({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, "prompt_completion", "x"), "x")
    assert ids == tok("Q: 2+2?\nA: 4<|endoftext|>")["input_ids"] and trained_text(tok, ids, mask) == " 4<|endoftext|>"
    set_chat_template(tok, "chatml")
    record = {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]}
    ids, mask = tokenize(tok, to_example(record, "prompt_completion", "x"), "x")
    assert trained_text(tok, ids, mask) == "Yo<|im_end|>\n"  # TRL's: all after the prompt's rendering
    ids, mask = tokenize(tok, to_example(record, "prompt_completion", "x"), "x", answer_end="end_of_turn")
    assert trained_text(tok, ids, mask) == "Yo<|im_end|>"
    ids, mask = tokenize(tok, to_example(record, "prompt_completion", "x"), "x", train_on_prompt=True)
    assert mask.all()


def test_a_template_that_rewrites_answers_is_refused():
    tok = load_tokenizer("gpt2")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(TemplateError, match="x:3: the chat template changes the text of assistant answers"):
        tokenize(tok, to_example({"messages": CONVERSATION}, "messages", "x:3"), "x:3")


def test_sharegpt_alpaca_and_system_prompt_become_conversations():
    ex = to_example({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                    "sharegpt", "x", system="Be kind.")
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant"]
    ex = to_example({"instruction": "Add", "input": "1 2", "output": "3"}, "alpaca", "x")
    assert ex.messages == [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]


def test_best_fit_decreasing_packs_whole_examples_tightly():
    lengths = np.random.default_rng(0).integers(5, 60, 500)
    rows = best_fit_decreasing(lengths, 128)
    assert sorted(k for r in rows for k in r) == list(range(500))
    assert all(lengths[r].sum() <= 128 for r in rows)
    assert lengths.sum() / (len(rows) * 128) > 0.95


def examples_of(lengths: list[int], seed: int = 0) -> ExampleSet:
    """Random ids with the first half of each example as prompt (not trained)."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 257, n) for n in lengths]
    masks = [np.arange(n) >= n // 2 for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return ExampleSet(np.concatenate(ids), np.concatenate(masks).astype(np.uint8), offsets,
                      np.arange(len(lengths)), {"format": "chat", "variant": "messages", "source": "x"})


@pytest.mark.parametrize("arch", TESTED_FAMILIES)
def test_packed_rows_give_each_examples_own_loss(tmp_path, arch):
    """No attention and no target across examples: the loss of packed rows is the sum of each example's alone.
    OPT's mask ignores position ids: packing is refused for it (check_packing), and this shows why."""
    from test_families import make_folder
    from transformers import AutoModelForCausalLM

    from shardlm.models.causal_lm import CausalLM

    hf = AutoModelForCausalLM.from_pretrained(make_folder(tmp_path, arch), dtype=torch.float32).eval()
    model = CausalLM(hf).eval()  # training adds a router's batch-level load-balancing loss (MoE)
    examples = examples_of([9, 14, 5, 20, 11, 7])
    packed = ExampleRows(examples, 32, packing=True)
    assert len(packed) < 6
    alone = ExampleRows(examples, 32, packing=False)
    def loss(rows: ExampleRows, r: int) -> torch.Tensor:
        b = rows.batch(np.array([r]))
        return model(b.inputs, b.targets, b.positions)[0]

    with torch.no_grad():
        packed_sum = sum(loss(packed, r) for r in range(len(packed)))
        alone_sum = sum(loss(alone, r) for r in range(len(alone)))
    assert packed.target_tokens == alone.target_tokens == sum(n - n // 2 for n in [9, 14, 5, 20, 11, 7])
    if arch in PACKING_FAMILIES:
        assert packed_sum.item() == pytest.approx(alone_sum.item(), rel=1e-5)
    else:
        assert packed_sum.item() != pytest.approx(alone_sum.item(), rel=1e-5)
        with pytest.raises(ShardlmError, match=f"data.packing=true would let packed examples attend to each other in "
                                               f"model family '{arch}'"):
            check_packing(hf.config, True)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"messages": CONVERSATION[:2]}


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ({"mesages": CONVERSATION[:2], "text": "x"}, r"bad\.jsonl:2: a chat example needs 'messages'"),
    ({"messages": []}, r"bad\.jsonl:2: 'messages' is an empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"bad\.jsonl:2: the conversation has no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     r"bad\.jsonl:2: message 1's 'content' is empty"),
    ({"prompt": "a", "completion": "b"}, r"bad\.jsonl:2: this record is a 'prompt_completion' example, but the first"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"},
                   {"role": "assistant", "content": "x"}]},
     r"bad\.jsonl:2: the chat template refuses this conversation"),  # plain has no tool turns
    ({"messages": [*CONVERSATION[:2], {"role": "bot", "content": "hi"}, *CONVERSATION[2:]]},
     r"bad\.jsonl:2: message 2 has role 'bot', which is not a chat role \(system, developer, user, assistant, tool, "
     r"function, ipython\): its turn would be context, never trained. Rename it \('assistant' if it is the model's"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
     r"bad\.jsonl:2: message 1 has role 'bot', which is not a chat role"),
    ({"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "x"}]},
     r"bad\.jsonl:2: the conversation has no assistant turn to train on \(it has none, only 'system', 'user'\)"),
])
def test_bad_examples_name_the_line_and_leave_no_cache(tmp_path, line, message):
    source = resolve(str(write_jsonl(tmp_path / "bad.jsonl", [GOOD, line])))
    tok = load_tokenizer("bytes")
    set_chat_template(tok, "plain")
    with pytest.raises(ShardlmError, match=message):
        build_examples(source, tok, DataConfig(format="chat"), tmp_path / "cache", log=lambda _: None)
    assert not any((tmp_path / "cache").iterdir())
    if not isinstance(line, str):  # on_bad_example=skip: the good one is kept, the bad one counted
        folder = build_examples(source, tok, DataConfig(format="chat", on_bad_example="skip"), tmp_path / "cache",
                                log=lambda _: None)
        assert load_examples(folder).meta["skipped"] == 1 and len(load_examples(folder)) == 1


def test_bytes_that_are_not_utf8_are_replaced_with_one_warning_as_for_text(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    line = json.dumps(GOOD).encode()
    path.write_bytes(line + b"\n" + line.replace(b"ab", b"a\xff\xfeb") + b"\n")  # twice: 4 bytes
    tok = load_tokenizer("bytes")
    set_chat_template(tok, "chatml")
    got = load_examples(build_examples(resolve(str(path)), tok, DataConfig(), tmp_path / "cache", log=lambda _: None))
    assert len(got) == 2 and "\ufffd" in tok.decode(got.example(1)[0].tolist())
    warning = f"warning: {path}: 4 bytes are not valid UTF-8 and were replaced by U+FFFD"
    assert capsys.readouterr().err.count(warning) == 1


def test_a_cache_of_conversations_is_keyed_by_how_answers_end(tmp_path):
    """answer_end=template changes the masks of conversations only: their cache is another one; text examples, and
    conversations with end_of_turn (what caches held before the setting), keep the key they had."""
    from shardlm.data.examples import examples_key

    tok = load_tokenizer("bytes")
    set_chat_template(tok, "chatml")
    text = {"prompt": "a", "completion": "b"}
    chat = {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]}
    sources = {name: (resolve(str(write_jsonl(tmp_path / f"{name}.jsonl", [record]))), variant)
               for name, record, variant in (("messages", GOOD, "messages"), ("chat", chat, "prompt_completion"),
                                             ("text", text, "prompt_completion"))}
    keys = {(name, end): examples_key(source, tok, DataConfig(answer_end=end), variant)
            for name, (source, variant) in sources.items() for end in ("template", "end_of_turn")}
    assert keys["messages", "template"] != keys["messages", "end_of_turn"]
    assert keys["chat", "template"] != keys["chat", "end_of_turn"]
    assert keys["text", "template"] == keys["text", "end_of_turn"]
    source = sources["messages"][0]  # the key of the caches written before the setting: theirs is end_of_turn's
    before = [2, source.identity(), fingerprint(tok), template_fingerprint(tok), "messages", False, "error", None]
    assert keys["messages", "end_of_turn"] == "ex-" + hashlib.sha256(json.dumps(before).encode()).hexdigest()[:20]


def test_no_chat_template_and_too_long_examples_are_clear_errors(tmp_path):
    source = resolve(str(write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 3)))
    with pytest.raises(ShardlmError, match="chat.jsonl:1: a conversation needs a chat template and tokenizer '.*' has "
                                           "none. Set model.chat_template"):
        build_examples(source, load_tokenizer("gpt2"), DataConfig(), tmp_path / "cache", log=lambda _: None)
    with pytest.raises(ShardlmError, match="example 0 has 20 tokens, more than data.seq_len=8"):
        ExampleRows(examples_of([20, 5]), 8, truncation="error", name="chat.jsonl")
    rows = ExampleRows(examples_of([20, 5]), 8, truncation="drop")
    assert rows.dropped == 1 and len(rows.ids) == 1
    assert ExampleRows(examples_of([20, 5]), 8).truncated == 1


def test_every_reader_gives_the_same_examples(tmp_path):
    """JSONL (gzip), Parquet, a save_to_disk folder, hf:json and a folder: the same ids and masks."""
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "a.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "arrow"))
    tok = load_tokenizer("bytes")
    set_chat_template(tok, "chatml")
    cfg = DataConfig(data_files=str(jsonl))
    built = [load_examples(build_examples(resolve(spec, "train", cfg.data_files), tok, cfg, tmp_path / "cache",
                                          log=lambda _: None))
             for spec in (str(jsonl), str(tmp_path / "gz"), str(tmp_path / "a.parquet"), str(tmp_path / "arrow"),
                          "hf:json")]
    for got in built:
        assert len(got) == 2 and got.meta["variant"] == "messages"
        assert np.array_equal(got.tokens, built[0].tokens) and np.array_equal(got.labels, built[0].labels)


def test_format_choice_and_text_files_are_clear_errors(tmp_path):
    from shardlm.config import load_config
    from shardlm.data.examples import source_format
    from shardlm.data.formats import detect

    with pytest.raises(ShardlmError, match=r"data.format='chats' is not one of auto, text, completion, chat, "
                                           r"preference. Did you mean 'chat'\?"):
        load_config(None, ["data.format=chats"])
    with pytest.raises(ShardlmError, match=r"data.answer_end='end-of-turn' is not one of template, end_of_turn. "
                                           r"Did you mean 'end_of_turn'\?"):
        load_config(None, ["data.answer_end=end-of-turn"])
    (tmp_path / "notes.txt").write_text("just text\n")
    with pytest.raises(ShardlmError, match="data.format=chat but '.*notes.txt' is plain text"):
        source_format(resolve(str(tmp_path / "notes.txt")), DataConfig(format="chat"))
    assert detect({"prompt": "p", "chosen": "a", "rejected": "b"}) == ("preference", "pairs")


def test_chatml_on_a_pretrained_vocabulary_without_room_says_use_plain(hf_folder):
    from shardlm.config import load_config
    from shardlm.models.hf_config import model_config
    from shardlm.tokenizer import model_tokenizer

    cfg = load_config(None, [f"model.name={hf_folder}", "model.chat_template=chatml"])
    with pytest.raises(ShardlmError, match="model.chat_template=chatml adds special tokens to tokenizer .* use "
                                           "model.chat_template=plain"):
        model_config(cfg, model_tokenizer(cfg.model))
    cfg = load_config(None, [f"model.name={hf_folder}", "model.chat_template=plain", "data.seq_len=32"])
    model_config(cfg, model_tokenizer(cfg.model))


def test_prepare_renders_example_sources(tmp_path, capsys):
    from shardlm.cli import main

    write_jsonl(tmp_path / "chat.jsonl", [GOOD] * 3)
    argv = ["prepare", f"data.train={tmp_path / 'chat.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
            "model.tokenizer=bytes", "model.chat_template=chatml"]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    assert "train: " in capsys.readouterr().out and len(list((tmp_path / "cache").glob("ex-*/meta.json"))) == 1


@pytest.mark.parametrize("end", ["template", "end_of_turn"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_pair_scores_what_instruction_tuning_trains(name, end):
    """A conversation pair's scored tokens are the targets instruction tuning gives the same conversation under
    the same data.answer_end: each assistant turn of the answer as the template closes it (with template, ChatML's
    newline after the last <|im_end|> too: TRL's DPO slice), not a tool or user turn between them."""
    from shardlm.data.formats import to_pair
    from shardlm.data.render import pair_ids

    tok, info = template_tokenizer(name), SOURCES[name]
    prompt = ([{"role": "system", "content": "Be brief."}] if info["supports_system"] else []) + CONVERSATION[:1]
    for answer in ([{"role": "assistant", "content": "ab"}], CONVERSATION[1:]):  # one turn; turn, user, turn
        (chosen, scored), _ = pair_ids(tok, to_pair({"prompt": prompt, "chosen": answer,
                                                     "rejected": [{"role": "assistant", "content": "ba"}]}, "x"), "x",
                                       end)
        ids, mask = tokenize(tok, to_example({"messages": prompt + answer}, "messages", "x"), "x", answer_end=end)
        assert chosen == ids[:len(chosen)] and scored.tolist() == mask[:len(chosen)].tolist()
        assert not mask[len(chosen):].any() and trained_text(tok, chosen, scored) == trained_text(tok, ids, mask)
        if name == "chatml.jinja":
            assert trained_text(tok, chosen, scored).endswith("<|im_end|>\n" if end == "template" else "<|im_end|>")
    with pytest.raises(ShardlmError, match="ends with a 'user' message; each side must end with the assistant's"):
        pair_ids(tok, to_pair({"prompt": prompt, "chosen": CONVERSATION[1:3],
                               "rejected": CONVERSATION[1:2]}, "x"), "x")


def test_a_conversation_ending_after_its_last_answer_is_counted_and_warned(tmp_path):
    """A trailing user turn has no answer to train: harmless, but likely a mistake in the data, so it is said."""
    trailing = {"messages": [*CONVERSATION[:2], {"role": "user", "content": "thanks"}]}
    source = resolve(str(write_jsonl(tmp_path / "chat.jsonl", [GOOD, trailing, trailing])))
    tok = load_tokenizer("bytes")
    set_chat_template(tok, "plain")
    said: list[str] = []
    folder = build_examples(source, tok, DataConfig(format="chat"), tmp_path / "cache", log=said.append)
    assert load_examples(folder).meta["unanswered"] == 2 and len(load_examples(folder)) == 3
    assert any(s.startswith("warning: 2 conversation(s) of ") and "end with a message after the last assistant "
               "answer" in s for s in said), said
