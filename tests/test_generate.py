"""Generation: a sliding window past the model's context, batched prompts (left padding) that give what one
prompt at a time gives, `shardlm generate`'s prompt file, streaming and JSON output."""

import io
import json

import pytest
import torch

from helpers import byte_gpt2_config
from shardlm import ShardlmError
from shardlm.cli import cmd_generate, parse_args
from shardlm.inference.generate import (
    DOCUMENT_END,
    generate_batch,
    generate_tokens,
    iter_samples,
    readable,
    text_printer,
)
from shardlm.tokenizer import byte_tokenizer

NEVER = -1  # an EOS id no model emits


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and lose 10x to them on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(n_positions: int = 16):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(byte_gpt2_config(n_positions=n_positions, n_embd=32, n_head=2)).eval()


def test_generation_slides_past_the_context():
    model, prompt = tiny_model(16), [97, 98, 99]
    [new] = generate_tokens(model, prompt, max_new_tokens=40, eos=NEVER, temperature=0)
    assert len(new) == 40  # not clipped to the 13 tokens that fit in one context
    ids = prompt + new
    first_round = model.generate(torch.tensor([prompt]), max_new_tokens=13, do_sample=False, pad_token_id=256,
                                 eos_token_id=NEVER)
    assert ids[:16] == first_round[0].tolist()
    # the second round continues from the last half-context (8 tokens) with a fresh cache
    with torch.no_grad():
        assert ids[16] == model(torch.tensor([ids[8:16]])).logits[0, -1].argmax().item()


def test_samples_are_seeded_and_cut_after_eos():
    model = tiny_model()
    a = generate_tokens(model, [120], 30, NEVER, temperature=1.0, top_k=5, seed=3, num_samples=2)
    assert a == generate_tokens(model, [120], 30, NEVER, temperature=1.0, top_k=5, seed=3, num_samples=2)
    assert len(a) == 2 and a[0] != a[1] and all(len(row) == 30 for row in a)
    [greedy] = generate_tokens(model, [120], 30, NEVER, temperature=0)
    stop = greedy[20]
    [cut] = generate_tokens(model, [120], 30, eos=stop, temperature=0)
    assert cut == greedy[:greedy.index(stop) + 1]


def test_batched_greedy_equals_one_by_one():
    """Prompts of 1 to 20 tokens (one longer than the 16-token context) in one left-padded batch: each row's
    positions come from its attention mask, it slides when its own window fills and leaves at its EOS."""
    model = tiny_model(16)
    prompts = [[97], [98, 99, 100], list(range(100, 110)), list(range(60, 80)), [120, 121]]
    alone = [generate_tokens(model, p, 30, NEVER, temperature=0)[0] for p in prompts]
    assert [samples for samples in generate_batch(model, prompts, 30, NEVER, temperature=0, pad=0)] == \
        [[row] for row in alone]
    stop = alone[1][5]  # an EOS that ends rows at different steps (greedy rows: cut after it)
    cut = [row[:row.index(stop) + 1] if stop in row else row for row in alone]
    assert any(len(row) < 30 for row in cut) and any(len(row) == 30 for row in cut)
    assert generate_batch(model, prompts, 30, eos=stop, temperature=0, num_samples=2) == [[row, row] for row in cut]


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "hf"
    tiny_model(16).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_prompt_file_json_lines_match_single_prompts(hf_folder, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["ROMEO:", "To be, or not to be", "é"]
    (tmp_path / "prompts.txt").write_text("ROMEO:\n\n  \nTo be, or not to be\r\né\n")
    greedy = ["--max-new-tokens", "24", "--temperature", "0"]
    assert cmd_generate(parse_args(["generate", str(hf_folder), "--prompt-file", str(tmp_path / "prompts.txt"),
                                    "--json", "--batch-size", "2", "--num-samples", "2", *greedy])) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["sample"]) for r in lines] == [(p, k) for p in prompts for k in range(2)]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(hf_folder), AutoTokenizer.from_pretrained(hf_folder)
    for r in lines:
        [alone] = iter_samples(model, tokenizer, [r["prompt"]], 24, temperature=0)
        assert (r["text"], r["new_tokens"]) == (alone.continuation, alone.new_tokens) and alone.text == \
            r["prompt"] + r["text"]
    # one prompt, one sample: streamed, and what is printed is the text plus a newline
    assert cmd_generate(parse_args(["generate", str(hf_folder), "--prompt", "ROMEO:", *greedy])) == 0
    assert capsys.readouterr().out == "ROMEO:" + lines[0]["text"] + "\n"


def test_streaming_prints_as_tokens_come():
    model, tokenizer = tiny_model(16), byte_tokenizer()
    writes = []

    class Terminal(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    term = Terminal()
    [sample] = iter_samples(model, tokenizer, ["ab"], 30, temperature=0, stream=term)  # slides past 16 positions
    assert term.getvalue() == sample.text + "\n" and len(writes) > 10 and writes[0] == "ab"
    printer = text_printer(tokenizer, [97], eos=256, file=(term := io.StringIO()))  # "a", then é in two bytes
    printer.put(torch.tensor([[97]]))  # the prompt, as generate puts it first
    printer.put(torch.tensor([0xC3]))
    assert term.getvalue() == "a"  # half a character is held back
    printer.put(torch.tensor([0xA9]))
    printer.close()
    assert term.getvalue() == "aé\n"


def test_people_see_document_ends_not_eos_and_no_cut_character(tmp_path, capsys):
    """`<|endoftext|>` reads as markup and a U+FFFD at the end is half a character: shown text has neither;
    --json keeps the exact decoding for scripts."""
    tokenizer = byte_tokenizer()
    cut = [*b"ab", 256, *"cé".encode(), 0xE2, 0x82]  # ends in 2 of the 3 bytes of "€"
    assert readable(tokenizer, cut) == "ab" + DOCUMENT_END + "cé"
    assert readable(tokenizer, [*b"ab", 256]) == "ab\n--- end of document ---"
    assert readable(tokenizer, [*b"a", 0xFF, *b"b"]) == "a\ufffdb"  # a bad byte inside is not a cut character
    model = tiny_model(16)
    with torch.no_grad():  # a model that ends every document at once: greedy EOS
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight[256] = 5.0
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    greedy = [str(tmp_path / "hf"), "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "5"]
    assert cmd_generate(parse_args(["generate", *greedy])) == 0
    assert capsys.readouterr().out == "ROMEO:\n--- end of document ---\n"
    assert cmd_generate(parse_args(["generate", *greedy, "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "<|endoftext|>"
    assert cmd_generate(parse_args(["generate", *greedy, "--num-samples", "2"])) == 0  # printed, not streamed
    assert capsys.readouterr().out == "ROMEO:\n--- end of document ---\n" * 2


@pytest.mark.parametrize("content,message", [(None, "prompt file '.*missing.txt' does not exist"),
                                             ("\n  \n\t\n", "holds no prompt .no non-blank line.")])
def test_bad_prompt_file_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / ("missing.txt" if content is None else "blank.txt")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ShardlmError, match=message) as error:  # before any model is loaded: no such path
        cmd_generate(parse_args(["generate", str(tmp_path / "no-model"), "--prompt-file", str(path)]))
    assert "\n" not in str(error.value)
    with pytest.raises(ShardlmError, match="--batch-size must be >= 1, got 0"):
        cmd_generate(parse_args(["generate", "x", "--batch-size", "0"]))
    with pytest.raises(ShardlmError, match="give --prompt or --prompt-file, not both"):
        cmd_generate(parse_args(["generate", "x", "--prompt", "a", "--prompt-file", str(path)]))
