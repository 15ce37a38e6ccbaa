"""`shardlm prepare [CONFIG] [key=value ...]`: build the token caches of data.train and data.val, then exit.

Tokenizing a large corpus inside `shardlm train` keeps every GPU of the job idle while it runs (and a
multi-node job waits on it within `parallel.timeout_s`); run this on a login node or as a CPU job first and
the training job finds its caches built. It uses every core (the tokenizers library's thread pool over
batches of token-neutral pieces; `RAYON_NUM_THREADS` caps it) and writes in order, so a cache is the same
file whatever the core count. Under torchrun or srun every rank may run it: the cache's lock lets one
process build each cache while the others wait and reuse it, and only rank 0 prints.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from shardlm import ShardlmError
from shardlm.config import Config


@dataclass
class Prepared:
    name: str  # train | train[i] (a mixture's sources) | val
    spec: str
    folder: Path
    documents: int
    tokens: int
    text_bytes: int | None  # None for a cache built by an older shardlm
    seconds: float
    cached: bool  # built earlier (by another run, or another rank while this one waited)
    unit: str = "document"  # or an example cache's: "example", "pair"; a prompt cache's "prompt"

    def line(self) -> str:
        mb = f"{self.text_bytes / 1e6:,.1f} MB" if self.text_bytes is not None else "? MB"
        speed = "" if self.text_bytes is None else f" ({self.text_bytes / 1e6 / max(self.seconds, 1e-3):,.1f} MB/s)"
        when = "built earlier" if self.cached else f"in {self.seconds:.1f}s{speed}"
        docs = f"{self.documents:,} {self.unit}{'s' if self.documents != 1 else ''}"
        return (f"{self.name}: {self.spec}: {docs}, {self.tokens:,} tokens, {mb}, {when}\n"
                f"  cache: {self.folder}")


def prepare(cfg: Config, log=print) -> list[Prepared]:
    from shardlm.config import objectives
    from shardlm.data.cache import build_cache, cache_root
    from shardlm.data.examples import build_examples, source_format
    from shardlm.data.prompt_cache import build_prompts, one_source, prompt_source
    from shardlm.data.sources import resolve
    from shardlm.tokenizer import model_tokenizer

    reads = objectives.spec(cfg).reads
    if reads == "unpaired":
        raise ShardlmError(f"shardlm prepare does not prepare train.objective={cfg.train.objective}'s labelled "
                           "examples yet: the run derives and renders them once, on its first start (or its --dry-run "
                           "checks them without writing).")
    prompts = reads == "prompts"  # online RL's, rendered with the generation prompt
    if prompts:
        one_source(cfg.data)
    tokenizer = model_tokenizer(cfg.model)
    root = cache_root(cfg.data.cache_dir)
    done = []
    train = cfg.data.train
    named = [(f"train[{i}]", spec, "train") for i, spec in enumerate(train)] if isinstance(train, list) else \
        [("train", train, "train")]  # every source of a mixture
    for name, spec, split in (*named, ("val", cfg.data.val, "validation")):
        if not spec:
            continue
        start = time.time()
        source = resolve(spec, split, cfg.data.data_files)
        logs: list[str] = []

        def tee(msg: str, logs: list[str] = logs) -> None:
            logs.append(msg)
            if not msg.startswith(("tokenized ", "rendered ")):  # the summary below says it
                log(msg)

        if prompts:
            source = prompt_source(spec, cfg.data, split, f"data.{name}")
            folder = build_prompts(source, tokenizer, cfg.data, root, log=tee)
        elif source_format(source, cfg.data)[0] != "text":  # examples: rendered with the chat template
            folder = build_examples(source, tokenizer, cfg.data, root, log=tee)
        else:
            folder = build_cache(source, tokenizer, root, cfg.data.text_field, cfg.data.hf_rows_are_documents,
                                 log=tee)
        meta = json.loads((folder / "meta.json").read_text())
        built_here = any(m.startswith(("tokenizing", "rendering")) for m in logs)
        unit = "pair" if "pairs" in meta else "example" if "examples" in meta else \
            "prompt" if "prompts" in meta else "document"
        done.append(Prepared(name, spec, folder, meta.get(f"{unit}s", 0), meta["num_tokens"],
                             meta.get("text_bytes"), meta.get("seconds", time.time() - start) if built_here else 0.0,
                             not built_here, unit))
    return done


def prepare_command(cfg: Config) -> int:
    rank = int(os.environ.get("RANK", "0"))
    quiet = (lambda *_: None) if rank else (lambda msg: print(msg, flush=True))
    done = prepare(cfg, log=quiet)
    if rank == 0:
        print("\n".join(p.line() for p in done))
        if not cfg.data.val:
            each = " of each source" if isinstance(cfg.data.train, list) else ""
            what = "prompts" if all(p.unit == "prompt" for p in done) else "tokens"
            print(f"val: none: the last {cfg.data.val_fraction:.0%} of the training {what}{each} are held out")
    return 0
