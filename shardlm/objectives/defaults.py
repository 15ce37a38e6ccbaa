"""What an objective does where it has nothing of its own to say: it reads blocks (text, examples or a mixture),
a step takes `global_batch` of them, it keeps no state of its own and any step may be saved. Language modelling
is all defaults; the other families override what differs (shardlm.objectives.base.Objective names each part)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.data import ExampleRows, TokenBlocks, describe, load_split, prepare_data
from shardlm.data.blocks import counted
from shardlm.models.hf_config import check_packing
from shardlm.objectives.base import Footprint, Loop, MemoryTerms
from shardlm.observe.metrics import describe_val


def check_packs(cfg: Config, hf_cfg: Any, train: Any) -> None:
    """Examples packed into rows only where the model's family keeps packed examples apart (`hf_cfg` None: a dry
    run whose model config could not be read)."""
    if hf_cfg is not None:
        check_packing(hf_cfg, cfg.data.packing and bool(describe(train)))


class Defaults:
    stats: ClassVar[tuple[str, ...]] = ()
    sampled: ClassVar[bool] = False  # its records are rates of sampled completions (online RL), not of blocks
    perplexity: ClassVar[bool] = True  # exp of its loss is a perplexity (a next-token loss)

    # ---- before the run ----------------------------------------------------------------------------------------
    @classmethod
    def load_data(cls, cfg: Config, tokenizer: Any, dist: Any, load: Callable | None = None) -> tuple[Any, Any]:
        return prepare_data(cfg.data, tokenizer, dist, load or load_split)

    @classmethod
    def check_data(cls, cfg: Config, hf_cfg: Any, train: Any, val: Any) -> None:
        """Packing where the model's family allows it; pairs are a preference objective's alone."""
        check_packs(cfg, hf_cfg, train)
        if any(isinstance(b, ExampleRows) and b.group == 2 for b in (train, val)):
            raise ShardlmError(f"the data holds preference pairs (chosen/rejected), which train.objective="
                               f"{cfg.train.objective} does not train on: set train.objective to dpo, ipo, simpo "
                               "or orpo.")

    @classmethod
    def count_steps(cls, cfg: Config, train: Any, world: int) -> int:
        """train.epochs counts the blocks of all sampled sources of a mixture together (weight 0: left out)."""
        t = cfg.train
        global_batch = world * t.batch_size * t.grad_accum
        blocks = getattr(train, "sampled_blocks", len(train))  # a mixture's weight-0 sources are left out
        if blocks < global_batch:
            raise ShardlmError(
                f"the training data has {counted(train, blocks, cfg.data.seq_len)}, fewer than one global "
                f"batch of {global_batch} (= {world} device{'s' * (world != 1)} x train.batch_size={t.batch_size} "
                f"x train.grad_accum={t.grad_accum}). Use more data or lower train.batch_size"
                f"{' / data.seq_len' if isinstance(train, TokenBlocks) else ''}.")
        if t.max_steps is not None:
            return t.max_steps
        return int(t.epochs * blocks // global_batch)

    @classmethod
    def check_resume(cls, cfg: Config, hf_cfg: Any, train: Any, val: Any, resumed: Any, on_main: Callable) -> None:
        pass

    @classmethod
    def data_line(cls, cfg: Config, train: Any, val: Any, steps: int, rows: int) -> str:
        seq = cfg.data.seq_len
        return (f"data: {getattr(train, 'sampled_blocks', len(train)):,} train / {len(val):,} val blocks of {seq} "
                f"tokens\n{steps} steps x {rows} blocks ({rows * seq:,} tokens per step)")

    @classmethod
    def count_line(cls, cfg: Config, train: Any, val: Any, steps: int, rows: int) -> str:
        """The dry run's line of the counted data."""
        blocks = f"{getattr(train, 'sampled_blocks', len(train)):,} train / {len(val):,} val blocks of " \
            f"{cfg.data.seq_len} tokens"
        return f"blocks: {blocks}; {steps:,} steps"

    @classmethod
    def preflight_lines(cls, cfg: Config, tokenizer: Any, train: Any) -> list[str]:
        """Each example source's packing line and its first example rendered, the trained tokens marked."""
        from shardlm.data.render import show_targets

        lines = describe(train)
        for part in getattr(train, "parts", [train]):
            if isinstance(part, ExampleRows) and len(part.ids):
                g = part.group
                shown = [show_targets(tokenizer, *part.examples.example(int(part.ids[0]) * g + j)) for j in range(g)]
                what = "first pair (chosen, then rejected; the scored answer tokens" if g == 2 else \
                    "first example (the trained tokens"
                lines.append(f"{what} between ⟦ ⟧):\n" + "\n".join(shown))
        return lines

    @classmethod
    def describe_val(cls, cfg: Config, result: dict[str, Any], held_out: int) -> str:
        """A validation result in words (the run's lines and `shardlm eval`'s)."""
        return describe_val(result, held_out, cfg.train.eval_batches)

    @classmethod
    def answer_tokens(cls, cfg: Config) -> int:
        return cfg.train.sample_tokens

    @classmethod
    def card_line(cls, cfg: Config) -> str | None:
        """The model card's "objective" row: what was optimized and its settings (None: the next-token loss)."""
        return None

    @classmethod
    def model_lines(cls, cfg: Config, tokenizer: Any) -> list[str]:
        """The dry run's lines on models beside the policy (a teacher), checked as the run checks them."""
        return []

    @classmethod
    def memory_rows(cls, cfg: Config, hf_cfg: Any) -> tuple[int, int, bool]:
        return cfg.train.batch_size, cfg.data.seq_len, False

    @classmethod
    def memory(cls, cfg: Config, f: Footprint) -> MemoryTerms:
        return MemoryTerms()

    # ---- in the run --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def resumed(self, loop: Loop) -> None:
        pass

    def tokens_seen(self, loop: Loop) -> int:
        return loop.position * loop.run.cfg.data.seq_len

    def advance(self, loop: Loop) -> int:
        return loop.global_batch

    def may_save(self, step: int, total: int) -> bool:
        return True

    def sample_lines(self) -> Iterable[str]:
        return ()
