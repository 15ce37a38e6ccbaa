"""`shardlm eval RUN --tasks NAMES`: EleutherAI's lm-evaluation-harness on the run's export.

The model is evaluated as its users will load it: the Hugging Face folder `shardlm export` writes (the run's
OUT_DIR/hf when it is of the evaluated checkpoint, else a temporary export), read by lm-eval's own `hf` backend,
so `lm_eval --model hf --model_args pretrained=FOLDER,dtype=float32 --tasks NAMES` gives the same numbers. The
device and batch size are `shardlm eval`'s: CUDA when there is one, else the CPU; the run's train.batch_size
(override it with train.batch_size=N).

The scores go to stderr as lm-eval's table, to stdout as one JSON line, and, for a run, into its metrics.jsonl:
one record per task, `{"step", "split": "lm_eval", "task", "acc", "acc_stderr", ..., "samples", "num_fewshot"}`,
at the checkpoint's step; lm-eval's whole results file is kept in OUT_DIR/lm_eval/.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardlm import ShardlmError
from shardlm.checkpoint.layout import metrics_file, nearby, read_manifest, resolve_checkpoint, run_dir_of
from shardlm.checkpoint.load import is_adapter_folder, is_hf_folder
from shardlm.config import Config, build_config, parse_overrides, to_flat_dict

SPLIT = "lm_eval"


def require() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise ShardlmError("shardlm eval --tasks runs EleutherAI's lm-evaluation-harness, which is not installed: "
                           "pip install 'shardlm[lmeval]' (or pip install lm-eval).")


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise ShardlmError("--tasks takes task names separated by commas, e.g. --tasks hellaswag,arc_easy.")
    return tasks


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager: the include_path's tasks alone when they are all that is asked for (indexing lm-eval's
    own ~15,000 task files takes seconds), else every task; an unknown name fails here, with the nearest ones."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ShardlmError(f"--include-path '{include_path}' is not a folder: give the folder of your task YAMLs.")
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks and not manager.match_tasks([t])]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ShardlmError(f"--tasks: no lm-eval task or group named '{unknown[0]}'.{hint} `lm-eval ls tasks` lists "
                           "them; a task of your own is a YAML file in a folder given with --include-path.")
    return manager


def _current_export(ckpt: Path) -> Path | None:
    """The run's OUT_DIR/hf when it was exported from this checkpoint (its model card's step) after it was saved."""
    run = run_dir_of(ckpt)
    hf = run / "hf" if run is not None else None
    if hf is None or not is_hf_folder(hf) or not (hf / "README.md").is_file():
        return None
    step = read_manifest(ckpt).get("step")
    card = (hf / "README.md").read_text(errors="replace")
    if f"| steps | {step} |" not in card or (hf / "config.json").stat().st_mtime < ckpt.stat().st_mtime:
        return None
    return hf


@contextlib.contextmanager
def exported(path: str) -> Iterator[tuple[Path, Path | None]]:
    """(an HF folder of the model at `path`, its checkpoint or None): an exported folder as it is; a run dir or
    checkpoint as its current OUT_DIR/hf, or exported into a temporary folder removed afterwards."""
    from shardlm.inference.export import export

    source = Path(path).expanduser()
    if is_hf_folder(source) or is_adapter_folder(source):
        yield source, None
        return
    ckpt = resolve_checkpoint(source, log=lambda m: print(m, file=sys.stderr))
    current = _current_export(ckpt)
    if current is not None:
        print(f"lm-eval reads {current} (the run's export of step {read_manifest(ckpt).get('step')})", file=sys.stderr)
        yield current, ckpt
        return
    with tempfile.TemporaryDirectory(prefix="shardlm-lm-eval-") as tmp, contextlib.redirect_stdout(sys.stderr):
        folder = export(ckpt, Path(tmp) / "hf")
        print(f"lm-eval reads a temporary export of {ckpt} (removed afterwards)", file=sys.stderr)
        yield folder, ckpt


def eval_settings(saved: Config | None, overrides: list[str]) -> tuple[str, int]:
    """`shardlm eval`'s device and batch size: CUDA when present, the run's train.batch_size unless overridden."""
    import torch

    flat = to_flat_dict(saved or Config())
    flat.update(parse_overrides(overrides))
    cfg = build_config({k: v for k, v in flat.items() if not k.startswith(("model.", "lora."))})
    return ("cuda" if torch.cuda.is_available() else "cpu"), cfg.train.batch_size


def task_records(results: dict[str, Any], step: int | None) -> list[dict[str, Any]]:
    """lm-eval's results -> one metrics.jsonl record per task or group: `acc,none` is `acc`; a metric of another
    filter is `acc/FILTER`; values lm-eval reports as N/A are left out."""
    records = []
    for task, scores in results["results"].items():
        record: dict[str, Any] = {"step": step, "split": SPLIT, "source": "eval", "task": task}
        for key, value in scores.items():
            metric, comma, flt = key.partition(",")
            if not comma or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            record[metric if flt == "none" else f"{metric}/{flt}"] = float(value)
        n = results.get("n-samples", {}).get(task)
        if n:
            record["samples"] = n["effective"]
        if task in results.get("n-shot", {}):
            record["num_fewshot"] = results["n-shot"][task]
        records.append(record)
    return records


def run_harness(path: str, tasks_text: str, overrides: list[str], limit: float | None = None,
                num_fewshot: int | None = None, include_path: str | None = None) -> dict[str, Any]:
    """Evaluate `path` (run dir, checkpoint or HF folder) on lm-eval tasks; print, record and return the scores."""
    require()
    tasks = parse_tasks(tasks_text)
    if not Path(path).expanduser().exists():
        raise ShardlmError(f"'{path}' does not exist.{nearby(Path(path).expanduser())} Give a run dir, a checkpoint "
                           "or an exported HF folder.")
    if limit is not None and limit <= 0:
        raise ShardlmError(f"--limit {limit:g}: give a number of examples per task (or a fraction below 1), > 0.")
    if num_fewshot is not None and num_fewshot < 0:
        raise ShardlmError(f"--num-fewshot {num_fewshot}: give 0 or more.")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with contextlib.redirect_stdout(sys.stderr):
        manager = task_manager(tasks, include_path)  # a bad name fails before any export
        from lm_eval import simple_evaluate
        from lm_eval.utils import make_table

        with exported(path) as (folder, ckpt):
            from shardlm.checkpoint.layout import read_config

            saved = read_config(ckpt) if ckpt is not None else None
            device, batch = eval_settings(saved, overrides)
            model_args: dict[str, Any] = {"pretrained": str(folder), "dtype": "float32",
                                          "trust_remote_code": bool(saved and saved.model.trust_remote_code)}
            if is_adapter_folder(folder):  # a PEFT adapter: lm-eval puts it on its base
                base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
                model_args |= {"pretrained": base, "peft": str(folder)}
            try:
                results = simple_evaluate(model="hf", model_args=model_args, tasks=tasks, batch_size=batch,
                                          device=device, limit=limit, num_fewshot=num_fewshot, task_manager=manager,
                                          log_samples=False)
            except (ValueError, FileNotFoundError, ConnectionError) as e:  # a task's data that cannot be had
                raise ShardlmError(f"lm-eval could not run {', '.join(tasks)}: {str(e).splitlines()[0]}") from None
    assert results is not None  # rank 0 of one process
    step = read_manifest(ckpt).get("step") if ckpt is not None else None
    records = task_records(results, step)
    print(make_table(results), file=sys.stderr)
    if results.get("groups"):
        print(make_table(results, "groups"), file=sys.stderr)
    print(f"(lm-eval {results.get('lm_eval_version', '?')} on {device}, batch {batch}"
          f"{f', limit {limit:g} per task' if limit else ''}; the same: lm_eval --model hf --model_args "
          f"pretrained=EXPORT,dtype=float32 --tasks {','.join(tasks)})", file=sys.stderr)
    _record(ckpt, records, results)
    out = {r["task"]: {k: v for k, v in r.items() if k not in ("step", "split", "source", "task")} for r in records}
    print(json.dumps({"lm_eval": out, "step": step}))
    return out


def _record(ckpt: Path | None, records: list[dict[str, Any]], results: dict[str, Any]) -> None:
    """Append the records to the run's metrics.jsonl and keep lm-eval's results file in OUT_DIR/lm_eval/."""
    run = run_dir_of(ckpt) if ckpt is not None else None
    if run is None or not metrics_file(run).is_file():
        return
    with open(metrics_file(run), "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    folder = run / "lm_eval"
    folder.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    kept = {k: v for k, v in results.items() if k not in ("samples", "pretty_env_info")}
    (folder / f"results_step{records[0]['step']}_{stamp}.json").write_text(json.dumps(kept, indent=2, default=str))
    print(f"appended {len(records)} record(s) to {metrics_file(run)} (split {SPLIT}, step {records[0]['step']}); "
          f"lm-eval's results: {folder}", file=sys.stderr)
