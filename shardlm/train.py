"""`shardlm train`: build the run, resume if a checkpoint exists, fit, export, show a sample."""

from __future__ import annotations

from shardlm.build import build
from shardlm.checkpoint import Checkpointer
from shardlm.config import Config
from shardlm.generate import gather_hf_model, generate_text
from shardlm.trainer import Trainer


def train(cfg: Config) -> dict:
    run = build(cfg)
    checkpointer = Checkpointer(run)
    trainer = Trainer(run, checkpointer)
    checkpointer.maybe_resume(trainer)
    result = trainer.fit()
    if trainer.stop_requested:
        return result
    run.dist.print(f"metrics: {run.out_dir / 'metrics.jsonl'} (plot: shardlm plot {run.out_dir}; "
                   f"checkpoints: {run.out_dir / 'checkpoints'})")
    if cfg.checkpoint.export_final:
        from shardlm.export import export

        run.dist.barrier()
        if run.dist.is_main:
            out = export(run.out_dir, run.out_dir / "hf")
            print(f"exported Hugging Face model to {out}", flush=True)
    if cfg.train.sample_tokens > 0 and trainer.step > 0:
        hf = gather_hf_model(run.model, run.hf_config, run.dist, str(run.dist.device))
        if hf is not None:
            text = generate_text(hf, run.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                                 temperature=0.8, top_k=200, seed=cfg.train.seed)[0]
            print(f"---- sample ({cfg.train.sample_tokens} tokens) ----\n{text}\n----", flush=True)
    return result
