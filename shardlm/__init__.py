"""shardlm: GPT-2-family language model training with PyTorch FSDP2."""

__version__ = "0.1.0"


class ShardlmError(Exception):
    """A problem the user can fix; the CLI prints its message without a traceback."""
