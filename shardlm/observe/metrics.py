"""What a run records: JSONL records (metrics.jsonl), TensorBoard scalars and the trackers, the FLOPs behind
MFU, and the words that say which held-out tokens a validation loss is over."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from shardlm import ShardlmError
from shardlm.checkpoint.layout import SUPERSEDED, metrics_file, superseded_file


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int, causal: bool = False) -> float:
    """nanoGPT/PaLM estimate: 6N for the matmuls, 12*L*H*Q*T (= 12*L*C*T) for attention. `causal`: llm.c's
    convention, which counts only the causal half of the attention scores (6*L*C*T): the same run reads a few
    points lower in MFU at GPT-2 sizes, and comparisons must use one convention on both sides."""
    return 6 * n_params + (6 if causal else 12) * n_layer * n_embd * seq_len


def eval_summary(loss_sum: float, correct: float, tokens: float) -> dict[str, float]:
    """Loss per token, perplexity, accuracy and the token count from sums over the scored tokens: the one summary
    of both evaluations (Trainer.evaluate during training, `shardlm eval` in shardlm.inference.evaluate)."""
    if tokens == 0:
        raise ShardlmError("nothing to evaluate: the validation data is shorter than one block.")
    loss = float(loss_sum) / float(tokens)
    return {"loss": loss, "ppl": math.exp(min(loss, 700)), "accuracy": float(correct) / float(tokens),
            "tokens": int(tokens)}


def held_out_words(tokens: int, held_out: int | None, eval_batches: int | None = None) -> str:
    """Which held-out tokens a validation loss is over. Training scores a subset (train.eval_batches) and
    `shardlm eval` all of them, and the two losses differ: each says which it is, so they are not taken for one."""
    if held_out is None:  # a record written before records carried held_out_tokens
        return f"on {tokens:,} held-out tokens"
    if tokens >= held_out:
        return f"on all {held_out:,} held-out tokens"
    return f"on {tokens:,} of {held_out:,} held-out tokens (a subset: train.eval_batches={eval_batches})"


def describe_val(result: dict, held_out: int | None, eval_batches: int | None) -> str:
    """A validation result in words: loss, perplexity and next-token accuracy of text or examples; of preference
    pairs (a result with `pairs`), the pair loss and the rewards, as `shardlm eval` prints them (the perplexity a
    pair record keeps is the chosen answers' per token, not exp(loss), so it is not printed as `ppl`)."""
    scope = held_out_words(result["tokens"], held_out, eval_batches)
    if "pairs" not in result:
        return f"loss {result['loss']:.4f} ppl {result['ppl']:.2f} accuracy {result['accuracy']:.3f} {scope}"
    return (f"loss {result['loss']:.4f} rewards/accuracy {result['rewards/accuracy']:.3f} rewards/margin "
            f"{result['rewards/margin']:.4f} (chosen {result['rewards/chosen']:.4f}, rejected "
            f"{result['rewards/rejected']:.4f}) on {result['pairs']:,} pair{'s' * (result['pairs'] != 1)}, "
            f"{scope.removeprefix('on ')}")


def _step_of(line: str) -> int | None:
    """A record's step; None for a line that is not a record (a write cut short by a kill)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("step") if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def supersede(out_dir: Path, step: int) -> str | None:
    """Before a run continues from `step` (a checkpoint's, or 0): the records of later steps, written by an attempt
    that stopped before its next save and trained again now, move from metrics.jsonl to metrics.superseded.jsonl,
    so each step has one record (plots and readers see one history) and nothing is lost. A last line cut short by
    a kill goes with them. Returns a note saying so, or None when there were none."""
    path = metrics_file(out_dir)
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8", errors="surrogateescape").splitlines(keepends=True)
    keep: list[str] = []
    moved: list[str] = []
    torn = False
    for i, line in enumerate(lines):
        found = _step_of(line)
        torn = found is None and i == len(lines) - 1 and not line.endswith("\n")
        target = moved if torn or (found is not None and found > step) else keep
        target.append(line if line.endswith("\n") else line + "\n")
    if not moved:
        if lines and not lines[-1].endswith("\n"):  # a record cut before its newline: the next must not join it
            with open(path, "a") as fh:
                fh.write("\n")
        return None
    with open(superseded_file(out_dir), "a", encoding="utf-8", errors="surrogateescape") as fh:
        fh.writelines(moved)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(keep), encoding="utf-8", errors="surrogateescape")
    os.replace(tmp, path)
    steps = [s for s in map(_step_of, moved) if s is not None]
    cut = "a line cut short by a kill" if torn else ""
    if not steps:
        return f"metrics.jsonl: {cut} moved to {SUPERSEDED}"
    span = f"s {min(steps)}-{max(steps)}" if max(steps) > min(steps) else f" {steps[0]}"
    return (f"metrics.jsonl: {len(steps)} record{'s' if len(steps) != 1 else ''} of step{span}{' and ' * torn}{cut}, "
            f"written after step {step} by an attempt that stopped before saving them, moved to {SUPERSEDED} (this "
            "run trains those steps again)")


class MetricsLog:
    """`metrics.jsonl` (one flushed line per record, so it can be tailed), TensorBoard and, given `cfg` with
    log.wandb / log.mlflow on, those trackers (shardlm.observe.tracking); `trackers` passes started ones instead.
    `first_step` (a run's, when it starts or resumes): a killed attempt's records past it are superseded (`supersede`;
    its note is `self.note`), and TensorBoard hides its events past it."""

    def __init__(self, out_dir: Path, tensorboard: bool, enabled: bool, trackers: list | None = None,
                 cfg=None, first_step: int | None = None):
        self.enabled = enabled
        if cfg is not None:
            from shardlm.observe import tracking

            tracking.require(cfg.log)  # on every rank, so all of them stop with the same one-line error
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
        self.note = supersede(out_dir, first_step) if enabled and first_step is not None else None
        self.file = open(metrics_file(out_dir), "a") if enabled else None  # noqa: SIM115
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = first_step + 1 if first_step is not None and (out_dir / "tensorboard").is_dir() else None
            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)
        self.trackers = list(trackers or [])
        if enabled and cfg is not None and trackers is None:
            from shardlm.observe import tracking

            self.trackers = tracking.start(cfg, out_dir)
        self.last_val: dict | None = None
        self.last_step: int | None = None

    def write(self, record: dict) -> None:
        if self.file is None:  # not rank 0
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        split = record.get("split", "train")
        scalars = {f"{split}/{key}": value for key, value in record.items()
                   if isinstance(value, (int, float)) and key not in ("step", "split")}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, record["step"])
        for tracker in self.trackers:
            tracker.log(scalars, record["step"])
        self.last_step = record["step"]
        if split == "val":
            self.last_val = record

    def summary(self) -> dict:
        """The final summary sent to the trackers: last validation loss/ppl/accuracy and the last step."""
        out = {} if self.last_step is None else {"final/steps": self.last_step}
        for key in ("loss", "ppl", "accuracy"):
            if self.last_val is not None and isinstance(self.last_val.get(key), (int, float)):
                out[f"final/val_{key}"] = self.last_val[key]
        return out

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        summary = self.summary()
        for tracker in self.trackers:
            if summary:
                tracker.summary(summary)
            tracker.close()
        self.trackers = []
