"""`shardlm train` (and `shardlm.train` from Python): build the run, resume if a checkpoint exists, fit, export, show a
sample."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from shardlm import ShardlmError
from shardlm.checkpoint import layout
from shardlm.checkpoint.layout import checkpoints_dir, metrics_file
from shardlm.config import Config, config_from_dict, save_config, to_flat_dict
from shardlm.data import describe
from shardlm.distributed.full_state import gather_hf_model
from shardlm.inference.generate import generate_text
from shardlm.inference.genquality import GenerationQuality, check_generation
from shardlm.objectives import objective_family
from shardlm.training.build import Run, build
from shardlm.training.trainer import Trainer


def train(cfg: Config, callbacks: Iterable[object] = (), *, continued: bool = False) -> dict:
    """`callbacks`: shardlm.callbacks objects (`shardlm train --callback SPEC` loads them by name). `continued`:
    the config was read from the run's own config.yaml (`shardlm resume`), so a change is one the user typed."""
    run = build(cfg)  # every check that can refuse the run comes first (shardlm.training.checks): nothing written
    trainer = Trainer(run, checkpoint=True, callbacks=[*callbacks, *generation_callback(run)])
    assert trainer.checkpointer is not None
    resumed = trainer.checkpointer.maybe_resume()
    if resumed and trainer.step >= run.total_steps > 0:
        run.dist.print(f"nothing to train: {resumed} is step {trainer.step} and this config ends at step "
                       f"{run.total_steps}. To train further raise train.max_steps (or train.epochs); to start "
                       "over use a new out_dir or checkpoint.resume=none.")
        return {"val": None, "steps": trainer.step, "wall_s": 0.0}
    if trainer.step > 0:  # what the objective stored for the run (a top-K teacher's scores), read before writing
        trainer.objective.resumed(trainer)
    if run.dist.is_main:
        record_config(cfg, run.out_dir, run.dist.print, hint=not continued)
    result = trainer.fit()
    if trainer.stop_reason:
        run.dist.print(f"stopped at step {trainer.step} for good ({trainer.stop_reason}); checkpoints: "
                       f"{checkpoints_dir(run.out_dir)}. A rerun stays stopped: to train on, drop the callback "
                       "or loosen it.")
        return result
    if trainer.stop_requested:
        run.dist.print(f"saved step {trainer.step} to {checkpoints_dir(run.out_dir)}; rerun the same command to "
                       "resume")
        return result
    checkpoints = checkpoints_dir(run.out_dir)
    run.dist.print(f"metrics: {metrics_file(run.out_dir)} (plot: shardlm plot {run.out_dir}"
                   + (f"; checkpoints: {checkpoints})" if checkpoints.is_dir() else ")"))
    if cfg.checkpoint.export_final:
        from shardlm.inference.export import export

        run.dist.barrier()
        if run.dist.is_main:
            out = export(run.out_dir, run.out_dir / "hf")
            print(f"exported Hugging Face model to {out}", flush=True)
    if cfg.train.sample_tokens > 0 and trainer.step > 0:
        hf = gather_hf_model(run.model, run.hf_config, run.dist, run.dist.generation_device)
        if hf is not None and describe(run.val):
            tokens = objective_family(cfg.train.objective).answer_tokens(cfg)  # online RL: its completions' length
            print(sample_answers(hf, run, tokens) or "", flush=True, end="")
        elif hf is not None:
            text = generate_text(hf, run.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                                 temperature=0.8, top_k=200, seed=cfg.train.seed)[0]
            print(f"---- sample ({cfg.train.sample_tokens} tokens) ----\n{text}\n----", flush=True)
    return result


def sample_answers(hf, run: Run, max_new_tokens: int, n: int = 3) -> str:
    """A run on examples ends with the model's greedy answers to the first validation prompts, beside the
    references (what `shardlm eval --exact-match` scores)."""
    from shardlm.inference.exact_match import held_out_examples, score

    d = run.cfg.data
    spec = d.val or (d.train[0] if isinstance(d.train, list) else d.train)
    try:
        examples = held_out_examples(spec, "validation", d, None if d.val else d.val_fraction, n)
    except ShardlmError:  # a mixture whose first source is text: no prompts to answer
        return ""
    lines = [f"prompt: {_clipped(s.prompt)}\n  answer: {_clipped(s.answer)}   reference: {_clipped(s.reference)}"
             for s in score(hf.eval(), run.tokenizer, examples, max_new_tokens, quiet=True)]
    return "---- answers to held-out prompts (greedy) ----\n" + "\n".join(lines) + "\n----\n"


def _clipped(text: str, limit: int = 160) -> str:
    """An answer that runs on without its end of turn (an early model) would fill the console: its start."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text) - limit:,} more characters)"


def generation_callback(run: Run) -> list[GenerationQuality]:
    """`train.gen_every`: checked here (`check_generation`, as the dry run checks it), on every rank, so a missing
    library or too few held-out blocks fail before training rather than on rank 0 alone at step N."""
    t = run.cfg.train
    check_generation(t, run.val)
    return [GenerationQuality(t.gen_every, t.gen_samples)] if t.gen_every else []


def record_config(cfg: Config, out_dir: Path, log=print, hint: bool = True) -> None:
    """Write `config.yaml` once training starts. A changed config of an earlier invocation is kept as
    `config.N.yaml` (N = 1, 2, ...) and the change is printed, so a run folder tells its whole history."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / layout.CONFIG
    if path.is_file():
        before = to_flat_dict(config_from_dict(yaml.safe_load(path.read_text()) or {}))
        now = to_flat_dict(cfg)
        changed = {k: (before.get(k), v) for k, v in now.items() if before.get(k) != v}
        if not changed:
            return
        n = 1 + max((int(p.stem.split(".")[1]) for p in out_dir.glob("config.*.yaml")
                     if p.stem.split(".")[1].isdigit()), default=0)
        path.rename(out_dir / f"config.{n}.yaml")
        log("config changed since the last invocation (previous kept as "
            f"config.{n}.yaml): " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
            + (f". (`shardlm resume {out_dir}` continues with the saved config, repeating nothing.)" if hint else "."))
    save_config(cfg, path)

