"""PyTorch/XLA on XLA:CPU through PJRT (`make test-xla`: .venv-xla, PJRT_DEVICE=CPU, CPU_NUM_DEVICES=2; the
2x2 hybrid layout sets 4). The runs on XLA are skipped where torch_xla is not installed, as in `make test`; what
XLA cannot do is refused from the config alone, and without torch_xla a run says how to install it.

Each run is a `shardlm train` process: the XLA runtime is configured once per process (device count, SPMD)."""

import importlib.util
import json
import shutil

import pytest
import torch
from faults import fault

from helpers import losses, records, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.distributed.parallelize import plan

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
needs_torch_xla = pytest.mark.skipif(not HAS_TORCH_XLA, reason="torch_xla is not installed (make test-xla)")

STEPS = 10


def xla_env(devices: int) -> dict[str, str]:
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}


def train(corpus, cache_dir, out, devices: int, **extra):
    args = tiny(corpus, cache_dir, out, **{"train.max_steps": STEPS, "train.batch_size": 4,
                                           "model.dropout": 0.0, "parallel.device": "xla", **extra})
    return shardlm_cli(["train", *args], env=xla_env(devices))


@needs_torch_xla
@pytest.mark.parametrize("devices, extra", [
    (2, {}),  # FSDPv2 full: parameters sharded over both devices
    (1, {}),  # one device
    (4, {"parallel.sharding": "hybrid_full", "parallel.shard_size": 2}),  # 2 replicas x 2 shards
    (2, {"parallel.sharding": "no_shard"}),  # replicated parameters, split batch
    (2, {"parallel.activation_checkpointing": True, "train.loss_chunk_size": 64}),  # and the chunked loss
])
def test_loss_equals_the_plain_cpu_run_on_the_same_global_batch(corpus, cache_dir, tmp_path, devices, extra):
    assert_parity(corpus, cache_dir, tmp_path, devices, extra)


@needs_torch_xla
def test_lora_on_xla_equals_lora_on_cpu(corpus, cache_dir, tmp_path):
    from transformers import GPT2LMHeadModel

    from helpers import byte_gpt2_config, save_hf_folder

    base = save_hf_folder(GPT2LMHeadModel(byte_gpt2_config(n_layer=2, n_embd=32, n_head=2)), tmp_path / "base")
    assert_parity(corpus, cache_dir, tmp_path, 2, {"model.name": base, "lora.r": 4, "lora.dropout": 0.0})


@needs_torch_xla
def test_distillation_on_xla_equals_distillation_on_cpu(corpus, cache_dir, tmp_path):
    """The frozen teacher beside the student on the SPMD mesh, and the chunked divergence's hand-written gradient,
    train what they train on CPU."""
    from transformers import GPT2LMHeadModel

    from helpers import byte_gpt2_config, save_hf_folder

    teacher = save_hf_folder(GPT2LMHeadModel(byte_gpt2_config(n_layer=2, n_embd=32, n_head=2)), tmp_path / "teacher")
    assert_parity(corpus, cache_dir, tmp_path, 2, {"train.objective": "distill", "distill.teacher": teacher,
                                                   "distill.beta": 0.5, "distill.alpha": 0.7,
                                                   "train.loss_chunk_size": 64})


def assert_parity(corpus, cache_dir, tmp_path, devices: int, extra: dict) -> None:
    proc = train(corpus, cache_dir, tmp_path / "xla", devices, **extra)
    assert f"XLA SPMD over {devices} device(s)" in proc.stdout
    same = {k: v for k, v in extra.items() if not k.startswith("parallel.")}  # the model, loss and LoRA settings
    cpu = tiny(corpus, cache_dir, tmp_path / "cpu", **{"train.max_steps": STEPS, "train.batch_size": 4 * devices,
                                                       "model.dropout": 0.0, **same})
    shardlm_cli(["train", *cpu], env={"PJRT_DEVICE": ""})
    assert losses(tmp_path / "xla") == pytest.approx(losses(tmp_path / "cpu"), rel=1e-4)
    assert len(losses(tmp_path / "xla")) == STEPS


@needs_torch_xla
def test_resume_is_exact_compilations_stay_bounded_and_the_export_loads_on_cpu(corpus, cache_dir, tmp_path):
    """bf16 with dropout and activation checkpointing: the XLA RNG and the parameters' sharding are restored."""
    extra = {"model.dropout": 0.1, "parallel.precision": "bf16", "parallel.activation_checkpointing": True,
             "checkpoint.every": 4, "train.max_steps": 12, "checkpoint.export_final": True,
             "train.sample_tokens": 8}  # the end-of-training sample gathers the weights from the devices
    train(corpus, cache_dir, tmp_path / "ref", 2, **extra)
    killed = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "run", **{
        "train.batch_size": 4, "parallel.device": "xla", **extra}), fault("KillAfterSave(8)")],
        env=xla_env(2), check=False)
    assert killed.returncode != 0
    shutil.copytree(tmp_path / "run", tmp_path / "on_cpu")  # the same checkpoint, resumed on the plain CPU path
    on_cpu = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "on_cpu", **{
        **extra, "train.batch_size": 8, "checkpoint.export_final": False})], env={"PJRT_DEVICE": ""})
    assert "resumed from" in on_cpu.stdout and len(losses(tmp_path / "on_cpu")) == 12
    resumed = train(corpus, cache_dir, tmp_path / "run", 2, **extra)
    assert "resumed from" in resumed.stdout
    by_step = {r["step"]: r["loss"] for r in records(tmp_path / "run")}
    assert [by_step[s] for s in range(1, 13)] == losses(tmp_path / "ref")  # bit for bit
    # the step compiles once: no new graphs after the first steps (nor across checkpoint saves)
    compiled = {r["step"]: r["xla_compilations"] for r in records(tmp_path / "ref")}
    assert compiled[12] == compiled[3], compiled

    hf, prompt = tmp_path / "ref" / "hf", "ROMEO:"
    greedy = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
    from_ckpt = shardlm_cli(["generate", str(tmp_path / "ref"), *greedy]).stdout
    from transformers import pipeline

    text = pipeline("text-generation", model=str(hf), device="cpu")(prompt, max_new_tokens=12,
                                                                     do_sample=False)[0]["generated_text"]
    assert text == from_ckpt.rstrip("\n") and text.startswith(prompt)
    result = json.loads(shardlm_cli(["eval", str(tmp_path / "ref"), "data.val=" + str(corpus)]).stdout.splitlines()[-1])
    assert result["loss"] > 0


@needs_torch_xla
def test_a_hybrid_group_that_does_not_divide_the_devices_is_one_line(corpus, cache_dir, tmp_path):
    args = tiny(corpus, cache_dir, tmp_path, **{"parallel.device": "xla", "parallel.sharding": "hybrid_full",
                                                "parallel.shard_size": 4})
    proc = shardlm_cli(["train", *args], env=xla_env(2), check=False)
    assert proc.returncode == 2 and "shard_size to divide the 2 XLA devices: 4 does not" in proc.stderr


@needs_torch_xla
def test_auto_takes_xla_only_where_pjrt_names_an_accelerator(monkeypatch):
    """Importing torch_xla sets PJRT_DEVICE=CPU where it is unset (transformers imports it to probe for it):
    that must not move `parallel.device=auto` runs onto XLA:CPU."""
    from shardlm.distributed import xla

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert not xla.wanted("auto") and xla.wanted("xla")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert xla.wanted("auto")


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.precision=fp16"], 1, "precision=fp16 is not supported on XLA.*parallel.precision=bf16"),
    (["parallel.compile=model"], 1, "compile=model is not supported on XLA.*compiles every step's graph itself"),
    (["parallel.sharding=hybrid_grad"], 1, "sharding=hybrid_grad is not supported on XLA.*hybrid_full"),
    (["parallel.activation_checkpointing=selective"], 1, "activation_checkpointing=selective is not supported on "
                                                         "XLA.*=full \\(or every:N\\)"),
    (["parallel.wrap=size:1M"], 1, "wrap=size:1M is not supported on XLA.*parallel.wrap=block"),
    ([], 2, "with 2 launched processes.*without a launcher"),
    (["train.objective=grpo", "data.seq_len=1024"], 1, "objective=grpo is not supported on XLA yet.*cuda/cpu"),
    (["train.objective=distill", "distill.teacher=t", "distill.on_policy=0.5", "data.seq_len=1024"], 1,
     "distill.on_policy=0.5 is not supported on XLA yet.*cuda/cpu"),
])
def test_what_xla_cannot_do_is_refused_before_any_work(overrides, world, message):
    with pytest.raises(ShardlmError, match=message):  # config values only: no torch_xla needed
        plan(load_config(None, overrides), world, world, torch.device("xla"))


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed")
def test_xla_without_torch_xla_says_how_to_install(corpus, cache_dir, tmp_path):
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"parallel.device": "xla"})], check=False)
    assert proc.returncode == 2 and "torch_xla is not installed" in proc.stderr and "make test-xla" in proc.stderr
    assert not tmp_path.joinpath("metrics.jsonl").exists()
