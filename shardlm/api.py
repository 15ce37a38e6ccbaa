"""shardlm from Python: the commands as typed functions, importable as `shardlm.train`, `shardlm.load`,
`shardlm.evaluate` (and `shardlm.Trainer` for a loop of your own).

    import shardlm

    shardlm.train("shakespeare_tiny", {"train.max_steps": 100}, out_dir="runs/mine")
    model = shardlm.load("runs/mine")                 # a checkpoint, a run dir or an exported HF folder
    print(model.generate("ROMEO:", max_new_tokens=50))
    print(shardlm.evaluate("runs/mine"))              # {"loss", "ppl", "accuracy", "tokens"}

Each takes what its command takes and does what it does (the same checks, messages and files); a problem the
user can fix raises `shardlm.ShardlmError`. Under torchrun, a script calling `shardlm.train` trains on every
rank as `shardlm train` does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardlm.config import Config, load_config
from shardlm.training.trainer import Trainer

__all__ = ["Model", "Trainer", "configure", "evaluate", "load", "train"]


def configure(source: str | Path | Config | None = None, overrides: Mapping[str, Any] | Sequence[str] = (),
           **keys: Any) -> Config:
    """A checked Config: `source` is a YAML path, a bundled config's name, a Config or None (the defaults);
    `overrides` dotted keys as a mapping ({"train.lr": 1e-3}) or `key=value` strings; keyword arguments
    spell the dots as `__` (train__lr=1e-3) or name a top-level key (out_dir="runs/x")."""
    items = _items(overrides, keys)
    if isinstance(source, Config):
        from shardlm.config import to_flat_dict

        return load_config(None, [*_items(to_flat_dict(source), {}), *items])
    return load_config(str(source) if source is not None else None, items)


def _items(overrides: Mapping[str, Any] | Sequence[str], keys: Mapping[str, Any]) -> list[str]:
    """`key=value` strings; Python values as JSON (a YAML subset), so types survive: "1e-3" stays a string."""
    given = dict(overrides) if isinstance(overrides, Mapping) else {}
    given.update({k.replace("__", "."): v for k, v in keys.items()})
    plain = [] if isinstance(overrides, Mapping) else list(overrides)
    return plain + [f"{k}={json.dumps(v, default=str)}" for k, v in given.items()]


def train(source: str | Path | Config | None = None, overrides: Mapping[str, Any] | Sequence[str] = (), *,
          callbacks: Iterable[object] = (), **keys: Any) -> dict[str, Any]:
    """`shardlm train SOURCE key=value ...`: resumes from out_dir's last checkpoint when there is one, as the
    command does. `callbacks` are shardlm.callbacks objects. Returns {"val": the final validation metrics,
    "steps", "wall_s"}."""
    from shardlm.runner import train as run

    return run(configure(source, overrides, **keys), callbacks)


@dataclass
class Model:
    """A trained model ready for inference: the transformers model, its tokenizer, and the run's config (None
    for a folder shardlm did not train)."""

    hf: Any
    tokenizer: Any
    run_config: Config | None
    path: Path

    def generate(self, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 0,
                 seed: int = 0) -> str:
        """The prompt and its continuation, as `shardlm generate` prints it (temperature 0: greedy)."""
        from shardlm.inference.generate import generate_text

        return generate_text(self.hf, self.tokenizer, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                             seed=seed)[0]


def load(path: str | Path, device: str = "cpu") -> Model:
    """A checkpoint (`RUN/checkpoints/step_N`), a run dir (its newest checkpoint) or an exported folder."""
    from shardlm.checkpoint.load import load_for_inference

    hf, tokenizer, run_config, _ = load_for_inference(path, device)
    return Model(hf.eval(), tokenizer, run_config, Path(path))


def evaluate(path: str | Path, overrides: Mapping[str, Any] | Sequence[str] = (), **keys: Any) -> dict[str, Any]:
    """`shardlm eval PATH key=value ...`: loss, perplexity and accuracy on the run's validation data (or
    data.val=...), as the command prints them."""
    from shardlm.inference.evaluate import evaluate_path

    return evaluate_path(str(path), _items(overrides, keys))
