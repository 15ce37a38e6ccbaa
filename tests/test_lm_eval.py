"""`shardlm eval RUN --tasks NAMES`: lm-evaluation-harness on a tiny run's export, offline, with local YAML tasks
over local JSONL files (a multiple-choice task and a rolling-loglikelihood perplexity task): the scores are
printed and recorded in the run's metrics.jsonl, and lm-eval's perplexity of a text agrees with `shardlm eval
--stride CONTEXT` on the same text (docs/generation.md explains the small difference)."""

from __future__ import annotations

import json
import math

import pytest

from helpers import SHAKESPEARE, records, tiny, train_in_process
from shardlm import ShardlmError
from shardlm.inference.harness import parse_tasks, run_harness, task_records

pytest.importorskip("lm_eval")

MC = """task: shakespeare_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
ROLLING = """task: shakespeare_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def local_tasks(folder):
    """The two task YAMLs and their data: 8 lines of Shakespeare to finish (the true second half among three
    others'), and one held-out passage to score."""
    folder.mkdir()
    lines = [line for line in SHAKESPEARE.read_text()[-40_000:].splitlines() if len(line) > 30]
    with open(folder / "mc.jsonl", "w") as f:
        for i in range(8):
            ends = [lines[(i + k * 9) % len(lines)][len(lines[(i + k * 9) % len(lines)]) // 2:] for k in range(4)]
            line = lines[i]
            f.write(json.dumps({"context": line[:len(line) // 2], "choices": ends, "label": 0}) + "\n")
    passage = "\n".join(lines[100:120])
    (folder / "text.jsonl").write_text(json.dumps({"text": passage}) + "\n")
    (folder / "mc.yaml").write_text(MC.format(data=folder / "mc.jsonl"))
    (folder / "text.yaml").write_text(ROLLING.format(data=folder / "text.jsonl"))
    return folder, passage


def test_lm_eval_scores_a_run_and_records_them(corpus, cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = tmp_path / "run"
    train_in_process(tiny(corpus, cache_dir, run, **{"checkpoint.export_final": True}))
    capsys.readouterr()
    tasks, passage = local_tasks(tmp_path / "tasks")

    scores = run_harness(str(run), "shakespeare_mc,shakespeare_text", [], limit=6, include_path=str(tasks))
    out, err = capsys.readouterr()
    assert "the run's export of step 10" in err  # OUT_DIR/hf is of the newest checkpoint: no second export
    assert "|shakespeare_mc" in err and "acc" in err  # lm-eval's table
    assert json.loads(out.strip().splitlines()[-1])["lm_eval"] == scores
    mc, text = scores["shakespeare_mc"], scores["shakespeare_text"]
    assert mc["samples"] == 6 and 0 <= mc["acc"] <= 1 and mc["acc_stderr"] > 0 and mc["num_fewshot"] == 0
    assert text["samples"] == 1 and text["bits_per_byte"] == pytest.approx(math.log2(text["byte_perplexity"]))
    recorded = records(run, "lm_eval")
    assert [r["task"] for r in recorded] == ["shakespeare_mc", "shakespeare_text"]
    assert all(r["step"] == 10 and r["source"] == "eval" for r in recorded)
    assert recorded[0]["acc"] == mc["acc"] and len(list((run / "lm_eval").glob("results_step10_*.json"))) == 1

    # lm-eval's rolling windows of the model's context are `shardlm eval --stride CONTEXT`'s windows: on the same
    # text the two perplexities agree to within a few percent (shardlm also scores the end-of-text token; lm-eval
    # the first byte after it, and its windows start one token earlier)
    (tmp_path / "passage.txt").write_text(passage)
    from shardlm.inference.evaluate import evaluate_path

    ours = evaluate_path(str(run), [f"data.val={tmp_path / 'passage.txt'}", f"data.cache_dir={cache_dir}"],
                         stride=64)
    assert ours["ppl"] == pytest.approx(text["byte_perplexity"], rel=0.05)


def test_lm_eval_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(ShardlmError, match="--tasks takes task names"):
        parse_tasks(" , ")
    with pytest.raises(ShardlmError, match="--include-path '.*nowhere' is not a folder"):
        run_harness(str(tmp_path), "x", [], include_path=str(tmp_path / "nowhere"))
    with pytest.raises(ShardlmError, match="'.*nothing' does not exist"):
        run_harness(str(tmp_path / "nothing"), "x", [])
    with pytest.raises(ShardlmError, match="--limit 0: give a number"):
        run_harness(str(tmp_path), "x", [], limit=0)
    from shardlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path), "--tasks", "x", "--stride", "8"])
    assert e.value.code == 2 and "--tasks runs lm-eval's tasks alone" in capsys.readouterr().err


def test_task_records_name_metrics_as_lm_eval_does():
    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                     "exact_match_stderr,strict-match": 0.1, "exact_match,flexible-extract": 0.5,
                                     "exact_match_stderr,flexible-extract": "N/A"}},
               "n-samples": {"gsm8k": {"original": 1319, "effective": 4}}, "n-shot": {"gsm8k": 5}}
    assert task_records(results, 7) == [{"step": 7, "split": "lm_eval", "source": "eval", "task": "gsm8k",
                                         "exact_match/strict-match": 0.25, "exact_match_stderr/strict-match": 0.1,
                                         "exact_match/flexible-extract": 0.5, "samples": 4, "num_fewshot": 5}]
