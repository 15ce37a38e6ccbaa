"""A warm process that forks each one-process `python -m shardlm ARGS` of the tests (helpers.shardlm_cli).

Most of a tiny run's CPU time is importing torch and transformers (about 6 of 6.6 CPU-seconds on this machine), and
the suite starts a few hundred such runs. This process imports them once; each request forks a child that does what
`python -m shardlm ARGS` does after its imports: its own folder, environment, argv, stdin and output files, then
shardlm.cli.main, then the interpreter's exit (non-daemon threads joined, atexit handlers run), in a process group of
its own that a timeout kills whole. helpers.shardlm_cli starts real processes instead when the environment differs
from this process's in anything read at import time, for multi-rank launches, and with SHARDLM_TEST_FORK=0.

Protocol, one JSON line each way on stdin/stdout: {"argv", "env", "cwd", "timeout", "stdout", "stderr"} (the two
capture files) -> {"rc", "timed_out"}.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback

# The environment read when torch, transformers and their libraries load (OpenMP's thread count at load time, the
# hub's offline flag at import): a request that differs from this process's in these runs as a real process.
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "CUDA_", "NCCL_",
               "TOKENIZERS_", "PYTHON", "LD_", "WANDB_", "MLFLOW_", "TF_", "XLA_", "PJRT_")


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


def _child(req: dict) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0, the devnull above
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
        import shardlm.__main__ as entry

        sys.argv = [entry.__file__, *req["argv"]]
        try:
            entry.main(req["argv"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does, in its order
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failure of this harness, shown as a process's would be
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing more to say
                stream.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        time.sleep(0.02)


def serve() -> None:
    import torch  # noqa: F401 - the imports every run pays, paid once here
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401

    import shardlm.cli  # noqa: F401
    import shardlm.runner  # noqa: F401

    reply = sys.stdout
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        rc, timed_out = _wait(pid, req["timeout"])
        print(json.dumps({"rc": rc, "timed_out": timed_out}), file=reply, flush=True)


if __name__ == "__main__":
    serve()
