"""KTO (`train.objective=kto`): TRL 1.16's KTOTrainer on unpaired examples, `{"prompt", "completion", "label"}`
records (text or conversational) whose `label` says whether the completion is desirable.

What it reads. Each record becomes a pair-shaped unit, written once beside the token cache (`kto-KEY/`, KEY the
source's identity) and rendered by the example cache as pairs are: the record's own completion, and a mismatched
one, the completion of the record before it within runs of `train.batch_size` records (TRL's rotation within
`per_device_train_batch_size`; at least 2). The records' labels lie beside them (`labels.npy`). Every record is
checked first, with its own `file:line`, so a bad one is named where the user wrote it.

The loss (shardlm.objectives.preference.kto_loss, equal to TRL's in value and gradient) compares the policy's
summed completion log-probability with the reference's (dpo's reference: precomputed once, or live) against the
KL reference point z: the mean of (policy - reference) over the mismatched completions, detached and clamped at
0. TRL takes z per micro-batch; here it is taken over the whole optimizer step (a no-grad pass over its
micro-batches, one all-reduce), so 2 ranks x 4 train what 1 x 8 trains; with grad_accum 1 on one process the two
are the same. The step's loss is the sum of the weighted per-example losses over the global example count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.config import objectives as specs
from shardlm.data import Batch, ExampleRows, load_split, prepare_data
from shardlm.data.cache import cache_root
from shardlm.data.formats import BadExample, to_pair
from shardlm.data.records import iter_records
from shardlm.data.sources import resolve
from shardlm.distributed.parallelize import set_gradient_sync
from shardlm.objectives.base import Loop, StepOut
from shardlm.objectives.preference.kto_loss import KTO_LOSS_TYPES, kl_from_sums, kto_losses
from shardlm.objectives.preference.pairs import Preference, reference_source
from shardlm.objectives.preference.reference import pair_rows
from shardlm.objectives.validate import Share

FORMAT = 1  # the derived records' layout: bump when it changes, so old derivations are not reused
STATS = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "count/chosen",
         "count/rejected")


def check_kto(cfg: Config) -> None:
    p = cfg.preference
    if p.kto_loss_type not in KTO_LOSS_TYPES:
        raise ShardlmError(f"preference.kto_loss_type={p.kto_loss_type!r} is not one of {', '.join(KTO_LOSS_TYPES)} "
                           "(TRL's KTOConfig.loss_type).")
    for name, value in (("desirable_weight", p.desirable_weight), ("undesirable_weight", p.undesirable_weight)):
        if not value > 0:
            raise ShardlmError(f"preference.{name} must be > 0, got {value} (TRL's default is 1.0).")
    if isinstance(cfg.data.train, list):
        raise ShardlmError("train.objective=kto reads one source of labelled examples; data.train is a list (a "
                           "mixture): merge the sources into one file.")


# ---- what it reads ----------------------------------------------------------------------------------------------
def _record(record: dict, where: str) -> tuple[Any, Any, bool]:
    """(prompt, completion, label) of one record, or one line naming what is wrong and where."""
    missing = [k for k in ("prompt", "completion", "label") if k not in record]
    if missing:
        raise BadExample(f"{where}: a KTO record needs 'prompt', 'completion' and 'label' (true: desirable, false: "
                         f"undesirable); this one lacks {', '.join(repr(k) for k in missing)}.")
    label = record["label"]
    if not isinstance(label, bool):
        raise BadExample(f"{where}: 'label' must be true or false (JSON booleans), got {label!r}.")
    return record["prompt"], record["completion"], label


def derive(spec: str, cfg: Config, folder: Path, name: str, default_split: str) -> tuple[str, str]:
    """The pair-shaped records of one source (`name`.jsonl) and their labels (`name`.labels.npy) under `folder`;
    (path, first error) where every record was bad and skipped."""
    source = resolve(spec, default_split, cfg.data.data_files)
    run = max(2, cfg.train.batch_size)
    rows: list[tuple[str, Any, Any, bool]] = []
    skipped: list[str] = []
    for where, record in iter_records(source):
        try:
            rows.append((where, *_record(record, where)))
        except BadExample as e:
            if cfg.data.on_bad_example != "skip":
                raise
            skipped.append(str(e))
    if not rows:
        raise ShardlmError(f"data source '{spec}' holds no KTO examples"
                           + (f" (all {len(skipped)} were skipped as bad; the first: {skipped[0]})" if skipped else "")
                           + ': give {"prompt", "completion", "label"} records.')
    pairs, labels = [], []
    for start in range(0, len(rows), run):
        chunk = rows[start:start + run]
        for i, (where, prompt, completion, label) in enumerate(chunk):
            mismatched = chunk[i - 1][2]  # the completion before it in its run (the last one for the first)
            pair = {"prompt": prompt, "chosen": completion, "rejected": mismatched}
            to_pair(pair, where, cfg.data.system_prompt)  # its types, checked where the user wrote it
            pairs.append(pair)
            labels.append(label)
    path = folder / f"{name}.jsonl"
    with open(path, "w") as out:
        for pair in pairs:
            out.write(json.dumps(pair) + "\n")
    np.save(folder / f"{name}.labels.npy", np.asarray(labels, dtype=bool))
    return str(path), skipped[0] if skipped else ""


def _key(cfg: Config) -> str:
    d = cfg.data
    named = ((d.train, "train"), (d.val, "validation"))
    sources = [resolve(str(s), split, d.data_files).identity() for s, split in named if s]
    ident = [FORMAT, sources, max(2, cfg.train.batch_size), d.on_bad_example, d.system_prompt]
    return "kto-" + hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:20]


def derived_data(cfg: Config, root: Path, log: Any = print) -> Config:
    """The run's config with data.train (and data.val) pointing at the derived pair-shaped records."""
    d = cfg.data

    def write(tmp: Path) -> dict:
        log(f"deriving KTO examples of {d.train}" + (f" and {d.val}" if d.val else "") + f" -> {root}")
        meta: dict[str, Any] = {"source": str(d.train)}
        for name, spec, split in (("train", d.train, "train"), ("val", d.val, "validation")):
            if spec:
                _, first_bad = derive(str(spec), cfg, tmp, name, split)
                if first_bad:
                    meta[f"{name}_skipped"] = first_bad
        return meta

    folder, built = _build_once(root, write)
    for key in ("train_skipped", "val_skipped"):
        if built and built.get(key):
            log(f"warning: skipped bad KTO records (data.on_bad_example=skip); the first: {built[key]}")
    data = replace(d, train=str(folder / "train.jsonl"), val=str(folder / "val.jsonl") if d.val else None,
                   format="preference")
    return replace(cfg, data=data)


def _build_once(folder: Path, write: Any) -> tuple[Path, dict | None]:
    """`folder` as `write(tmp)` fills it, renamed whole (its meta.json last): never rewritten once there, so the
    example cache keyed by the derived files' size and time is found again by every later run."""
    if (folder / "meta.json").is_file():
        return folder, None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = write(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(folder)
    except OSError:
        if not (folder / "meta.json").is_file():  # not another process's finished copy: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, meta


def labels_of(rows: ExampleRows) -> np.ndarray:
    """Each unit's label (True: desirable), read from beside the derived records its example set was rendered from."""
    source = Path(rows.examples.meta["source"])
    labels = np.load(source.with_name(f"{source.stem}.labels.npy"))
    return labels[rows.examples.records[0::2]]


# ---- the objective ----------------------------------------------------------------------------------------------
class KTO(Preference):
    """KTO on the pair-shaped units: sequence 0 is the record's completion, sequence 1 the mismatched one."""

    names: ClassVar[tuple[str, ...]] = specs.names("kto")
    stats: ClassVar[tuple[str, ...]] = ()  # the step's statistics come reduced over every rank, as a dict

    @classmethod
    def load_data(cls, cfg: Config, tokenizer: Any, dist: Any, load: Any = None) -> tuple[Any, Any]:
        check_kto(cfg)
        root = cache_root(cfg.data.cache_dir) / _key(cfg)
        if dist is None:  # the dry run: derived and rendered in memory, nothing written that stays
            with tempfile.TemporaryDirectory(prefix="shardlm-dry-") as tmp:
                data = derived_data(cfg, Path(tmp) / root.name, log=lambda _: None).data
                return prepare_data(data, tokenizer, None, load or load_split)
        paths = json.loads(dist.run_on_main(lambda: json.dumps(_paths(cfg, root, dist.print))))
        if not Path(paths[0]).is_file():  # a node that cannot see rank 0's cache derives its own copy
            paths = _paths(cfg, root, dist.print)
        data = replace(cfg.data, train=paths[0], val=paths[1], format="preference")
        return prepare_data(data, tokenizer, dist)

    @classmethod
    def card_line(cls, cfg: Config) -> str | None:
        p = cfg.preference
        return (f"kto on labelled examples (preference.beta {p.beta:g}, kto_loss_type {p.kto_loss_type}, "
                f"desirable_weight {p.desirable_weight:g}, undesirable_weight {p.undesirable_weight:g}, reference "
                f"{p.reference})")

    @classmethod
    def describe_val(cls, cfg: Config, result: dict[str, Any], held_out: int) -> str:
        """A side the examples lack has no rewards (NaN in the run, null in metrics.jsonl): said as n/a."""
        def value(key: str) -> str:
            v = result.get(key)
            return "n/a" if v is None or v != v else f"{v:.4f}"

        return (f"loss {value('loss')} kl {value('kl')} rewards/chosen {value('rewards/chosen')} rewards/rejected "
                f"{value('rewards/rejected')} on {result.get('examples', 0):,} labelled examples")

    def __init__(self, cfg: Config, device: torch.device, build_model: Any = None):
        super().__init__(cfg, device, build_model)
        self.labels: dict[int, torch.Tensor] = {}  # by the example set's id: each unit's label

    def _desirable(self, rows: ExampleRows, units: torch.Tensor) -> torch.Tensor:
        key = id(rows.examples)
        if key not in self.labels:
            self.labels[key] = torch.from_numpy(labels_of(rows)).to(self.device)
        return self.labels[key][units.to(self.device)]

    def _logps(self, model: Any, batch: Batch, split: str,
               ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(units, 2) policy and reference log-probabilities of the micro-batch's completions and mismatched ones
        (`ref`: the reference's, already scored in the step's first pass)."""
        assert batch.segments is not None and batch.units is not None
        n = len(batch.units)
        if ref is None:
            ref = self.reference[split][batch.units] if self.reference else self.live_logps(model, batch, 2 * n)
        logps, _ = model.sequence_logps(batch.inputs, batch.targets, batch.positions, batch.segments, 2 * n)
        return logps.view(-1, 2), ref

    def kl_sums(self, model: Any, batch: Batch, split: str,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([Σ (policy - reference) over the mismatched completions, their count], the reference's values), no
        gradient: the step's second pass reuses the reference's instead of scoring again (a live one is a forward)."""
        with torch.no_grad():
            policy, ref = self._logps(model, batch, split)
        w = torch.ones(len(policy), device=policy.device) if weights is None else weights
        return torch.stack([((policy[:, 1].double() - ref[:, 1].double()) * w).sum(), w.sum().double()]), ref

    def kto(self, model: Any, rows: ExampleRows, batch: Batch, split: str, kl: torch.Tensor,
            weights: torch.Tensor | None = None, ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ weighted losses, the STATS' sums but kl) of a micro-batch's units."""
        assert batch.units is not None
        policy, ref = self._logps(model, batch, split, ref)
        p, desirable = self.p, self._desirable(rows, batch.units)
        out = kto_losses(policy[:, 0], ref[:, 0], desirable, kl, p.beta, p.desirable_weight, p.undesirable_weight,
                         p.kto_loss_type)
        w = torch.ones(len(policy), device=policy.device) if weights is None else weights
        d = desirable.to(w.dtype) * w
        u = w - d
        r, lp = out.rewards.double(), policy[:, 0].detach().double()
        stats = torch.stack([(r * d).sum(), (r * u).sum(), (lp * d).sum(), (lp * u).sum(), d.sum().double(),
                             u.sum().double()])
        return (out.losses * w).sum(), stats

    def micro_steps(self, trainer: Loop) -> StepOut:
        """The KL reference point over the step's micro-batches (no gradient), then their losses: (the step's
        global example count, this rank's loss sum, the step's statistics over every rank)."""
        rows = pair_rows(trainer.run.train, "training")
        if not self.ready:
            self.prepare(reference_source(trainer))
            trainer.model.train()
        step_rows = trainer.sampler.indices(trainer.position, trainer.global_batch)
        examples = max(1, rows.units(step_rows))
        share = trainer.batch * trainer.accum / trainer.global_batch  # gradients are averaged over ranks
        batches = [trainer.train_batch(m) for m in range(trainer.accum)]
        kl_sums = torch.zeros(2, dtype=torch.float64, device=trainer.device)
        refs: list[torch.Tensor | None] = [None] * len(batches)
        for m, batch in enumerate(batches if self.p.kto_loss_type == "kto" else ()):  # apo_zero_unpaired: no z
            with trainer.autocast():
                sums_m, refs[m] = self.kl_sums(trainer.model, batch, "train")
            kl_sums += sums_m
        trainer.dist.all_reduce_sum(kl_sums)
        kl = kl_from_sums(kl_sums[0], kl_sums[1].clamp(min=1))
        loss_sum = torch.zeros((), device=trainer.device)
        sums = torch.zeros(6, dtype=torch.float64, device=trainer.device)
        for m, batch in enumerate(batches):
            set_gradient_sync(trainer.model, m == trainer.accum - 1)
            with trainer.autocast():
                losses, stats = self.kto(trainer.model, rows, batch, "train", kl, ref=refs[m])
            loss = losses / (examples * share)
            (trainer.scaler.scale(loss) if trainer.scaler else loss).backward()
            loss_sum += losses.detach()
            sums += stats
        trainer.dist.all_reduce_sum(sums)
        return examples, loss_sum, step_stats(sums.tolist(), float(kl))

    def validate(self, loop: Loop) -> dict[str, Any]:
        """TRL's metrics on the validation examples: the KL reference point over them, then the loss against it."""
        rows = pair_rows(loop.run.val, "validation")
        self.prepare(reference_source(loop))
        kl = loop.validator.validate(loop.model, rows, KLScores(self))["kl"] if self.p.kto_loss_type == "kto" else 0.0
        return loop.validator.validate(loop.model, rows, KTOScores(self, torch.tensor(kl, device=self.device)))


def step_stats(sums: list[float], kl: float) -> dict[str, float]:
    """TRL's per-side means: rewards and log-probabilities over the desirable (chosen) and undesirable (rejected)
    examples; NaN for a side the step did not have (TRL leaves it out of that record)."""
    rc, rr, lc, lr, nc, nr = sums
    return {"kl": kl, "rewards/chosen": rc / nc if nc else float("nan"),
            "rewards/rejected": rr / nr if nr else float("nan"), "logps/chosen": lc / nc if nc else float("nan"),
            "logps/rejected": lr / nr if nr else float("nan"), "count/chosen": nc, "count/rejected": nr}


def _weights(share: Share, batch: Batch) -> torch.Tensor:
    rows, valid = share.rows, share.valid
    w = np.repeat(valid, [len(rows.rows[r]) for r in share.indices]).astype(np.float32)
    return torch.from_numpy(w).to(batch.inputs.device)


class KLScores:
    """The validation examples' KL reference point (shardlm.objectives.validate's Scorer); padding weighs nothing."""

    fields = ("kl_sum", "kl_count")

    def __init__(self, kto: KTO):
        self.kto = kto

    def sums(self, model: Any, batch: Batch, share: Share) -> dict[str, torch.Tensor | float]:
        (total, count), _ = self.kto.kl_sums(model, batch, "val", _weights(share, batch))
        return {"kl_sum": total, "kl_count": count}

    def result(self, totals: dict[str, float]) -> dict[str, Any]:
        return {"kl": max(0.0, totals["kl_sum"] / max(totals["kl_count"], 1.0))}


class KTOScores:
    """KTO's loss on the validation examples against their reference point, and TRL's per-side metrics."""

    fields = ("loss_sum", "rc", "rr", "lc", "lr", "nc", "nr")

    def __init__(self, kto: KTO, kl: torch.Tensor):
        self.kto, self.kl = kto, kl

    def sums(self, model: Any, batch: Batch, share: Share) -> dict[str, torch.Tensor | float]:
        losses, stats = self.kto.kto(model, share.rows, batch, "val", self.kl, _weights(share, batch))
        return {"loss_sum": losses, **dict(zip(self.fields[1:], stats, strict=True))}

    def result(self, totals: dict[str, float]) -> dict[str, Any]:
        n = totals["nc"] + totals["nr"]
        stats = step_stats([totals[k] for k in self.fields[1:]], float(self.kl))
        return {"loss": totals["loss_sum"] / max(n, 1.0), "examples": int(n), **stats}


def _paths(cfg: Config, root: Path, log: Any) -> list[str | None]:
    derived = derived_data(cfg, root, log).data
    return [str(derived.train), derived.val]
