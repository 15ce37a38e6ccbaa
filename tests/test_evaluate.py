"""`shardlm eval` on bad input: an export without data settings, `--generation` options checked before any
model is loaded, and too little validation data for the asked generations."""

import pytest

from shardlm import ShardlmError


def test_eval_of_an_export_needs_data(hf_folder):
    from shardlm.inference.evaluate import evaluate_path

    with pytest.raises(ShardlmError, match="carries no data settings: pass data.val=PATH"):
        evaluate_path(str(hf_folder), [])


def test_generation_options_are_checked_before_loading(tmp_path, monkeypatch):
    import sys

    from shardlm.inference.evaluate import GenOptions, evaluate_path

    missing = str(tmp_path / "no-run")
    with pytest.raises(ShardlmError, match="--generation must be >= 0"):
        evaluate_path(missing, [], gen=GenOptions(n=-1))
    with pytest.raises(ShardlmError, match=r"--top-p must be in \(0, 1\]"):
        evaluate_path(missing, [], gen=GenOptions(n=4, top_p=0))
    monkeypatch.setitem(sys.modules, "mauve", None)
    with pytest.raises(ShardlmError, match=r"need the [a-z-]+ package, which is not installed: .*shardlm\[gen\]"):
        evaluate_path(missing, [], gen=GenOptions(n=4))


def test_generation_without_validation_data(hf_folder, tmp_path):
    pytest.importorskip("mauve")
    from shardlm.inference.evaluate import GenOptions, evaluate_path

    with pytest.raises(ShardlmError, match="carries no data settings: pass data.val=PATH"):
        evaluate_path(str(hf_folder), [], gen=GenOptions(n=4))
    (tmp_path / "short.txt").write_text("x" * 100)
    with pytest.raises(ShardlmError, match="--generation 4 needs 4 held-out blocks of 32 tokens, but the validation "
                                           "data holds 3: lower --generation or data.seq_len"):
        evaluate_path(str(hf_folder), [f"data.val={tmp_path / 'short.txt'}", "data.seq_len=32",
                                       f"data.cache_dir={tmp_path / 'cache'}"], gen=GenOptions(n=4))


def test_eval_progress_lines_end_at_the_whole(capsys):
    """Without a terminal: a line after the first batch (an early ETA), then the last one, not a stop at 53%."""
    from shardlm.observe.progress import EvalProgress

    progress = EvalProgress(total=193, steps=2)
    progress.update(103)
    progress.update(90)  # within every_s of the first line: not printed yet
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["eval 103/193 tokens (53.4%)", "eval 193/193 tokens (100.0%)"]


# ---- shardlm eval scores what the run validated, family by family -------------------------------------------------
# Tiny random-weight pretrained folders whose weights are drawn wide (initializer_range 0.5): their logits are large,
# so a logit transform left out shows (Gemma 2 soft-caps them, Granite divides them, Cohere multiplies them by its
# default logit_scale, 0.0625). Without the transform the loss was 2x off (Gemma 2: 12.07 vs 6.21).
FAMILIES = {"gpt2": {}, "llama": {}, "gemma2": {"final_logit_softcapping": 2.0, "sliding_window": 16},
            "granite": {"logits_scaling": 4.0}, "cohere": {}}
SIZES = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 4, "model.n_kv_head": 2,
         "model.intermediate_size": 64, "model.n_positions": 64}


def family_folder(root, arch: str):
    import json

    import torch

    from helpers import save_hf_folder
    from shardlm.config import load_config
    from shardlm.models.hf_config import model_config
    from shardlm.models.instantiate import empty_model
    from shardlm.tokenizer import byte_tokenizer

    extra = json.dumps({**FAMILIES[arch], "initializer_range": 0.5})
    overrides = [f"{k}={v}" for k, v in SIZES.items()] + [f"model.arch={arch}", "model.tokenizer=bytes",
                                                          f"model.config_overrides={extra}", "data.seq_len=32"]
    hf_cfg = model_config(load_config(None, overrides), byte_tokenizer())
    torch.manual_seed(0)
    return save_hf_folder(empty_model(hf_cfg, "cpu"), root / arch)


def chat_split(path, n: int, seed: int):
    """`n` conversations of 1-2 exchanges (reverse a word), as a chat JSONL."""
    import json
    import random

    rng, lines = random.Random(seed), []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 2)):
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 6)))
            messages += [{"role": "user", "content": f"Reverse {word}"}, {"role": "assistant", "content": word[::-1]}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def stride_loss(hf, tokens, context: int, stride: int) -> float:
    """The sliding-window protocol under transformers' own `labels=` loss: each window's targets not scored before."""
    import numpy as np
    import torch

    ids, last = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None], len(tokens) - 1
    nll = count = prev_end = 0
    for begin in range(0, last, stride):
        end = min(begin + context, last)
        labels, fresh = ids[:, begin + 1:end + 1].clone(), end - max(prev_end, begin)
        labels[:, :labels.shape[1] - fresh] = -100
        with torch.no_grad():
            nll += hf(input_ids=ids[:, begin:end], labels=ids[:, begin:end], shift_labels=labels).loss.item() * fresh
        count, prev_end = count + fresh, end
        if end == last:
            break
    return nll / count


@pytest.mark.parametrize(("arch", "data"), [*((arch, "text") for arch in FAMILIES), ("gemma2", "examples")])
def test_eval_scores_what_the_run_validated_and_transformers_does(arch, data, corpus, cache_dir, tmp_path, capsys):
    """`shardlm eval` of the run, and of its export, gives the run's last validation loss, which is transformers'
    own `labels=` loss of those blocks (or answers); `--stride` is transformers' loss of each window's new tokens.
    The summary line is training's (observe.metrics.describe_val)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import SHAKESPEARE, records, tiny, train_in_process
    from shardlm.config import load_config
    from shardlm.data import TokenBlocks
    from shardlm.inference.evaluate import _validation_tails, evaluate_path
    from shardlm.inference.export import export
    from shardlm.observe.metrics import describe_val
    from shardlm.tokenizer import model_tokenizer

    if data == "text":
        train, val, extra = corpus, tmp_path / "val.txt", {}
        val.write_text(SHAKESPEARE.read_text()[-1000:])
    else:
        train, val = chat_split(tmp_path / "chat.jsonl", 48, 0), chat_split(tmp_path / "val.jsonl", 12, 1)
        extra = {"model.chat_template": "plain"}
    run = tmp_path / "run"
    args = [a for a in tiny(train, cache_dir, run, **{
        "model.name": family_folder(tmp_path, arch), "data.val": val, "train.max_steps": 3, "train.eval_batches": 0,
        "train.warmup_steps": 0, "model.dropout": 0.0, **extra}) if a.split("=")[0] not in SIZES]
    train_in_process(args)
    want = records(run, "val")[-1]["loss"]
    capsys.readouterr()
    got = evaluate_path(str(run), [])
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert describe_val(got, got["held_out_tokens"], 0) in capsys.readouterr().err.splitlines()
    hf_dir = export(run, tmp_path / "hf")
    exported = evaluate_path(str(hf_dir), [f"data.val={val}", f"data.cache_dir={cache_dir}", "data.seq_len=32"])
    assert exported["loss"] == pytest.approx(want, rel=1e-5)

    cfg = load_config(None, args)
    tails = _validation_tails(cfg, model_tokenizer(cfg.model), torch.device("cpu"), exported=False)
    rows = tails[0] if data == "examples" else TokenBlocks(tails[0], 32)
    b = rows.batch(np.arange(len(rows)))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=b.inputs, position_ids=b.positions, labels=b.inputs,
                    shift_labels=b.targets.contiguous()).loss
    assert theirs.item() == pytest.approx(want, rel=1e-5)
    if data == "text" and FAMILIES[arch] or arch == "cohere":  # the transforms, on a short stream (a window a batch)
        short = tmp_path / "short.txt"
        short.write_text(SHAKESPEARE.read_text()[-300:])
        strided = evaluate_path(str(run), [f"data.val={short}"], stride=24)
        stream = _validation_tails(load_config(None, [*args, f"data.val={short}"]), model_tokenizer(cfg.model),
                                   torch.device("cpu"), exported=False)[0]
        assert strided["loss"] == pytest.approx(stride_loss(hf, stream, 64, 24), rel=1e-5)


def test_pairs_of_an_export_score_with_a_reference_free_objective_only(hf_folder, tmp_path):
    """An exported folder records no reference (the model a run started from): dpo is refused in one line, simpo
    scores every pair through the same evaluation as a run's validation."""
    import json

    from shardlm.inference.evaluate import evaluate_path

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"}) + "\n"
                             for i in range(8)))
    data = [f"data.val={pairs}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    with pytest.raises(ShardlmError, match="train.objective=dpo scores pairs against the reference, the model a run "
                                           "started from: an exported folder does not record it"):
        evaluate_path(str(hf_folder), [*data, "train.objective=dpo"])
    got = evaluate_path(str(hf_folder), [*data, "train.objective=simpo"])
    assert got["pairs"] == 8 and got["tokens"] == got["held_out_tokens"] > 0
    assert got["rewards/margin"] == pytest.approx(got["rewards/chosen"] - got["rewards/rejected"], abs=1e-6)
