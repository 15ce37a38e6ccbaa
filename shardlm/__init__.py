"""shardlm: GPT-2-family language model training with PyTorch FSDP2."""

__version__ = "0.1.0"


class ShardlmError(Exception):
    """A problem the user can fix; the CLI prints its message without a traceback."""


_API = ("train", "load", "evaluate", "configure", "Trainer", "Model")  # not `config`: that is a subpackage


def __getattr__(name: str):  # the Python API (shardlm.api), imported on first use: `import shardlm` stays light
    if name in _API:
        from shardlm import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardlm' has no attribute '{name}'")
