"""`shardlm train`: build the run, fit, evaluate, show a sample."""

from __future__ import annotations

import sys

from shardlm.build import build
from shardlm.config import Config
from shardlm.generate import gather_hf_model, generate_text
from shardlm.trainer import Trainer


def train(cfg: Config) -> dict:
    run = build(cfg)
    checkpointer = None
    try:
        from shardlm.checkpoint import Checkpointer

        checkpointer = Checkpointer(run)
    except ImportError:
        pass
    trainer = Trainer(run, checkpointer)
    if checkpointer:
        checkpointer.maybe_resume(trainer)
    result = trainer.fit()
    if cfg.train.sample_tokens > 0 and trainer.step > 0:
        hf = gather_hf_model(run.model, run.hf_config, run.dist, str(run.dist.device))
        if hf is not None:
            text = generate_text(hf, run.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                                 temperature=0.8, top_k=200, seed=cfg.train.seed)[0]
            print(f"---- sample ({cfg.train.sample_tokens} tokens) ----\n{text}\n----", file=sys.stdout, flush=True)
    return result
