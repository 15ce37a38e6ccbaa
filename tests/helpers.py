"""Shared helpers of the tests: a tiny config, the torchrun command line, and runners of the CLI.
Fixtures and pytest hooks are in conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardlm.distributed.launch import descendants

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "shardlm" / "assets" / "tinyshakespeare" / "input.txt"
# A small model over GPT-2's 50257-token vocabulary, where the loss's memory shows (test_estimate, test_loss)
GPT2_VOCAB = {"model.tokenizer": "gpt2", "model.n_layer": 4, "model.n_embd": 256, "model.n_head": 4,
              "model.n_positions": 128, "data.seq_len": 128, "train.batch_size": 4}
_device = "cpu"  # parallel.device of tiny(): "auto" (CUDA when present) while a @pytest.mark.cuda test runs (conftest)


def benchmark_module(name: str, monkeypatch):
    """benchmarks/NAME.py as a module. The benchmarks are scripts, not a package the tests import: the script is
    loaded explicitly by its path (importlib), with benchmarks/ on sys.path for this test only, as when it runs
    (it imports benchmarks/common.py as `common`)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as an imported module is (dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def on_cuda() -> bool:
    """Inside a @pytest.mark.cuda test on a machine with a GPU."""
    import torch

    return _device == "auto" and torch.cuda.is_available()


def fp32_tol(cpu: float) -> float:
    """Tolerance of an fp32 comparison: `cpu` on CPU; 2e-3 on CUDA, where shardlm runs fp32 matmuls in TF32."""
    return 2e-3 if on_cuda() else cpu


def tiny(corpus: Path, cache_dir: Path, out_dir: Path, **extra) -> list[str]:
    """Overrides for a ~40K-parameter byte-level GPT that trains in seconds (eager; on CPU unless the test is
    marked cuda)."""
    values = {
        "data.train": corpus, "data.cache_dir": cache_dir, "out_dir": out_dir,
        "model.n_layer": 2, "model.n_embd": 32, "model.n_head": 2, "model.n_positions": 64,
        "data.seq_len": 32, "train.batch_size": 8, "train.max_steps": 10, "train.log_every": 1,
        "train.eval_every": 0, "train.eval_batches": 4, "train.warmup_steps": 2, "train.lr": 3e-3,
        "train.sample_tokens": 0, "log.tensorboard": False, "log.progress": "lines",
        "parallel.device": _device, "parallel.compile": "false",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def byte_gpt2_config(**overrides):
    """A tiny GPT-2 config over the byte vocabulary (256 bytes + EOS id 256)."""
    from transformers import GPT2Config

    return GPT2Config(**{"vocab_size": 257, "n_positions": 64, "n_layer": 1, "n_embd": 8, "n_head": 1,
                         "bos_token_id": 256, "eos_token_id": 256, **overrides})


def python_cmd(*args: str, nproc: int = 0) -> list[str]:
    """The command line of `python ARGS`; with nproc > 1, under torchrun with that many ranks on this machine:
    `python -m torch.distributed.run --standalone --nproc-per-node=NPROC ARGS` (ARGS: a script or `-m MODULE`)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    return [sys.executable, *launcher, *args]


def shardlm_cli(args: list[str], nproc: int = 0, env: dict | None = None, timeout: int = 300,
                check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m shardlm ARGS` (under torchrun with nproc > 1), seeing no GPU unless the test is marked cuda; in
    the test's own folder (conftest's `_own_folder`) unless `cwd` says otherwise."""
    cmd = python_cmd("-m", "shardlm", *args, nproc=nproc)
    hide_gpus = {} if _device == "auto" else {"CUDA_VISIBLE_DEVICES": ""}
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **hide_gpus, **(env or {})}
    proc = run_command(cmd, full_env, timeout, cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_script(name: str, *args: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """tests/scripts/NAME ARGS under torchrun with `nproc` ranks, seeing no GPU and one thread a rank (as shardlm_cli's
    runs); a failure fails the test with the script's output."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(python_cmd(str(ROOT / "tests" / "scripts" / name), *args, nproc=nproc), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


_zygotes: dict = {}  # tests/zygote.py processes of this worker, by the import-time environment they started with


def forked(cmd: list[str], args: list[str], env: dict[str, str], timeout: float, cwd: Path | None
           ) -> subprocess.CompletedProcess | None:
    """`python -m shardlm ARGS` forked from a process that has imported torch and transformers already
    (tests/zygote.py, one per import-time environment: what OpenMP and the hub read when they load), or None where
    it must be a real process: with SHARDLM_TEST_FORK=0, and in a test on CUDA (a child forked from a process whose
    torch has asked for the GPU cannot start CUDA: "Cannot re-initialize CUDA in forked subprocess")."""
    import tempfile

    from zygote import import_time_env

    if os.environ.get("SHARDLM_TEST_FORK", "1") == "0" or on_cuda():
        return None
    key = tuple(sorted(import_time_env(env).items()))
    if key not in _zygotes or _zygotes[key].poll() is not None:
        zygote = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py"))], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert zygote.stdout is not None and json.loads(zygote.stdout.readline()) == {"ready": True}
        _zygotes[key] = zygote
    zygote = _zygotes[key]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"argv": args, "env": env, "cwd": str(cwd or Path.cwd()), "timeout": timeout, "stdout": str(out),
                   "stderr": str(err)}
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        reply = json.loads(zygote.stdout.readline())
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, reply["rc"], stdout, stderr)


def run_command(cmd: list, env: dict[str, str], timeout: float, cwd: Path | None) -> subprocess.CompletedProcess:
    """A command line (shardlm_cli's, a docs or README line): `python -m shardlm ...` forked (`forked`), anything
    else (torchrun's ranks, other programs) a real process."""
    if cmd[1:3] == ["-m", "shardlm"] and (proc := forked(cmd, [str(a) for a in cmd[3:]], env, timeout, cwd)):
        return proc
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (torchrun's ranks start sessions of their own)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def records(out_dir: Path, split: str = "train") -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def curve(out_dir: Path) -> list[tuple[int, float, float]]:
    """A run's (step, loss, gradient norm) records: what two ways of splitting the same run must agree on."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(out_dir)]


def assert_same_curve(got: list, want: list, tol: float = 1e-5) -> None:
    assert [s for s, *_ in got] == [s for s, *_ in want]
    for (_, loss, norm), (_, loss_1, norm_1) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_1, abs=tol) and norm == pytest.approx(norm_1, rel=tol)


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in records(out_dir)]


def save_hf_folder(model, folder: Path) -> Path:
    """A local Hugging Face folder (the model and shardlm's byte tokenizer), as a hub download would give."""
    from shardlm.tokenizer import byte_tokenizer

    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def by_step(out_dir: Path) -> dict[int, float]:
    """A run's training loss by step (a step run again, after a resume, keeps its last record)."""
    return {r["step"]: r["loss"] for r in records(out_dir)}


# ---- LoRA (test_lora.py, test_qlora.py; the bases and reference runs are conftest's lora_bases, lora_runs) ----
LORA_STEPS = 8


def lora_args(corpus: Path, cache_dir: Path, out: Path, base: Path, **extra) -> list[str]:
    """tiny()'s overrides for a LoRA run (r=4, alpha 8) of LORA_STEPS steps on the pretrained folder `base`."""
    return tiny(corpus, cache_dir, out, **{"model.name": base, "lora.r": 4, "lora.alpha": 8,
                                           "train.max_steps": LORA_STEPS, "checkpoint.every": 4,
                                           "train.batch_size": 8, **extra})


def train_in_process(args: list[str]):
    from shardlm.config import load_config
    from shardlm.runner import train

    return train(load_config(None, args))


def folder_digest(folder: Path) -> str:
    """Every file's name, size, mtime and bytes: equal digests, a folder nobody wrote to."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}".encode() + p.read_bytes())
    return h.hexdigest()


def save_lora_base(folder: Path, family: str, seed: int) -> Path:
    """A tiny random pretrained folder to put adapters on: Llama (GQA, untied) or GPT-2."""
    import torch
    from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=257, max_position_embeddings=64, bos_token_id=256, eos_token_id=256))
    else:
        model = GPT2LMHeadModel(byte_gpt2_config(n_layer=2, n_embd=16, n_head=2))
    return save_hf_folder(model, folder)


def generate_from_path(path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8) -> list[str]:
    """What `shardlm generate PATH --json` gives for one prompt, in process: the samples, prompt included, decoded
    exactly (EOS as the tokenizer writes it), to compare with transformers' pipeline."""
    from shardlm.inference.generate import iter_samples, load_generator

    model, tokenizer = load_generator(str(path))
    return [s.text for s in iter_samples(model, tokenizer, [prompt], max_new_tokens, temperature, 0, 1.0, 0, 1)]


def refusal(argv: list[str]) -> str:
    """The message `shardlm ARGV` refuses with, in this process (the CLI prints it as `error: ...`, exit 2)."""
    from shardlm import ShardlmError
    from shardlm.cli import parse_args

    args = parse_args(argv)
    try:
        args.fn(args)
    except ShardlmError as e:
        return str(e)
    return ""


# A chat template that renders Hermes tool calls in few tokens (its tool block lists the names only).
TOOLS_TEMPLATE = """{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


def tools_tokenizer():
    from shardlm.tokenizer import byte_tokenizer, set_chat_template

    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")  # its two special tokens
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def calling_model(folder: Path, prompt_len: int, result: str = "42", answer: str = "42", width: int = 256,
                  sure: float = 10.0) -> Path:
    """A real GPT-2 whose weights are set by hand so that it writes CALL as its first turn and `answer` after the
    tool turn of `result`, whatever it is asked, for prompts of `prompt_len` tokens (its next token is a function of
    the position alone: one-hot position embeddings read by an untied head): a model that calls tools, in a test.
    `sure` scales the script's logits: 10 is certain, 0.68 misses about one token in 200."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.objectives.rl.tools import tool_turn_ids
    from shardlm.tokenizer import end_of_turn_id

    tok = tools_tokenizer()
    eot = end_of_turn_id(tok)
    first = tok(CALL, add_special_tokens=False)["input_ids"] + [eot]
    turn = tool_turn_ids(tok, [{"role": "tool", "name": "multiply", "content": result}], eot)
    second = tok(answer, add_special_tokens=False)["input_ids"] + [eot]
    script = dict(enumerate(first, prompt_len)) | dict(enumerate(second, prompt_len + len(first) + len(turn)))
    cfg = GPT2Config(vocab_size=len(tok), n_positions=width, n_embd=width, n_head=2, n_layer=1,
                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.transformer.ln_f, *(n for b in model.transformer.h for n in (b.ln_1, b.ln_2))):
            norm.weight.fill_(1.0)
        model.transformer.wpe.weight.copy_(torch.eye(width))
        for position, token in script.items():
            model.lm_head.weight[token, position - 1] = sure  # the position before predicts it
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
