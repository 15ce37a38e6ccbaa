"""LoRA with PEFT under FSDP2: adapters alone train (1 process and 2 FSDP ranks agree), checkpoints hold the
adapter and the base's identity and resume exactly, exports (merged and PEFT adapter) agree, generate and eval
work on LoRA runs, the base folder is never written, and bad input fails with one line. QLoRA: test_qlora.py."""

import json
import shutil

import pytest
import torch
from faults import SigtermAt, fault

from helpers import LORA_STEPS, by_step, folder_digest, lora_args, shardlm_cli, tiny, train_in_process
from shardlm import ShardlmError

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


def test_lora_fsdp_adapters_only_parity_and_exact_resume(lora_bases, lora_runs, corpus, cache_dir, tmp_path,
                                                          monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from shardlm.config import load_config
    from shardlm.runner import train
    from shardlm.training.trainer import Trainer

    folders, digests = lora_bases
    reference = by_step(lora_runs["llama"])
    assert sorted(reference) == list(range(1, LORA_STEPS + 1)) and reference[LORA_STEPS] < reference[1]

    # 1 process: gradients reach the adapters alone, the optimizer holds the adapters alone
    trainer = Trainer.from_config(load_config(None, lora_args(corpus, cache_dir, tmp_path / "one", folders["llama"])))
    trainer.model.train()
    trainer.forward_backward_step(trainer.train_batch(0))
    named = dict(trainer.model.named_parameters())
    with_grad = {n for n, p in named.items() if p.grad is not None}
    adapters = {n for n in named if ".lora_" in n}
    assert with_grad == adapters and len(adapters) == 2 * 7 * 2  # A and B x 7 projections x 2 blocks
    in_optimizer = {id(p) for g in trainer.run.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(named[n]) for n in adapters}

    # exact resume, 1 process: stopped (SIGTERM) after step 4 and resumed == uninterrupted, bit for bit
    split = tmp_path / "split"
    train(load_config(None, lora_args(corpus, cache_dir, split, folders["llama"], **{"checkpoint.every": 0})),
          callbacks=[SigtermAt(4)])
    assert max(by_step(split)) == 4
    train_in_process(lora_args(corpus, cache_dir, split, folders["llama"], **{"checkpoint.every": 0}))
    assert by_step(split) == reference

    # 2 FSDP ranks (AC + CPU offload), killed after the step-4 save, resumed with another strategy (no_shard)
    fsdp = tmp_path / "fsdp"
    two = {"train.batch_size": 4, "parallel.activation_checkpointing": True, "parallel.cpu_offload": True}
    proc = shardlm_cli(["train", *lora_args(corpus, cache_dir, fsdp, folders["llama"], **two),
                        fault("KillAfterSave(4)")], nproc=2, check=False)
    assert proc.returncode != 0 and max(by_step(fsdp)) == 4
    resumed = shardlm_cli(["train", *lora_args(corpus, cache_dir, fsdp, folders["llama"], **{
        "train.batch_size": 4, "parallel.sharding": "no_shard"})], nproc=2)
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout
    got = by_step(fsdp)
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), step

    # the checkpoint: adapter weights and their optimizer state only, and the base's identity
    ckpt = fsdp / "checkpoints" / "step_000000008"
    keys = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    optim_keys = {k for k in keys if k.startswith("optim.state.")}
    assert model_keys and all(".lora_" in k for k in model_keys)
    assert optim_keys and all(".lora_" in k for k in optim_keys)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["lora"]["r"] == 4 and manifest["base"]["path"] == str(folders["llama"].resolve())
    assert len(manifest["base"]["weights_sha256"]) == 64 and len(manifest["base"]["config_sha256"]) == 64
    assert {n: folder_digest(f) for n, f in folders.items()} == digests  # the base folders were never written


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_exports_generate_and_eval_agree(lora_bases, lora_runs, family, corpus, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, pipeline

    from helpers import generate_from_path
    from shardlm.checkpoint.load import load_for_inference
    from shardlm.inference.evaluate import evaluate_path
    from shardlm.inference.export import export
    from shardlm.models.lora import inference_state

    folders, digests = lora_bases
    run = lora_runs[family]
    merged_dir, adapter_dir = export(run, tmp_path / "merged"), export(run, tmp_path / "adapter", adapter=True)
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()
    assert not any(adapter_dir.glob("model*.safetensors"))

    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    base = AutoModelForCausalLM.from_pretrained(str(folders[family])).eval()
    with_adapter = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(x).logits, with_adapter(x).logits
        plain = AutoModelForCausalLM.from_pretrained(str(folders[family]))(x).logits
    assert (a - b).abs().max() < 1e-5
    assert (a - plain).abs().max() > 1e-3  # the adapter changed the model

    # generate on the run dir == transformers.pipeline on the merged export (greedy)
    prompt = "ROMEO:"
    text = pipeline("text-generation", model=str(merged_dir), device="cpu")(
        prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert generate_from_path(str(run), prompt, max_new_tokens=12, temperature=0)[0] == text

    # eval on the run dir == eval on the merged export
    val = [f"data.val={corpus}", "data.seq_len=32", "train.batch_size=4", "train.eval_batches=4"]
    assert evaluate_path(str(run), val) == pytest.approx(evaluate_path(str(merged_dir), val), rel=1e-5)

    # the tensor-level merge (used on gathered training weights) == PEFT's merge_and_unload
    from shardlm.checkpoint.load import load_lora_checkpoint, resolve_checkpoint
    from shardlm.config import config_from_dict

    ckpt = resolve_checkpoint(run)
    import yaml

    cfg = config_from_dict(yaml.safe_load((ckpt / "config.yaml").read_text()))
    peft_model = load_lora_checkpoint(ckpt, cfg)
    inner = peft_model.get_base_model()
    ours = inference_state(inner.state_dict(), inner)
    theirs = load_for_inference(run)[0].state_dict()
    assert set(ours) == set(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6
    assert {n: folder_digest(f) for n, f in folders.items()} == digests


def test_base_identity_hashes_every_weight_byte_and_rereads_only_changed_files(tmp_path):
    """A base changed in a few projection weights (same size, header and config) is another base; a checkpoint's
    record of an unchanged file (name, size, mtime) is trusted, so a resume reads nothing."""
    import os

    from safetensors.torch import save_file

    from shardlm.checkpoint import provenance

    save_file({"w": torch.zeros(1_000_000)}, str(tmp_path / "model.safetensors"))  # 4 MB: 16 x 64 KiB samples miss most
    first = provenance.base_identity(str(tmp_path))
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[len(data) // 2 + 100_000] ^= 1  # between two of the sampled digest's 64 KiB reads
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    changed = provenance.base_identity(str(tmp_path))
    assert changed["weights_sha256"] != first["weights_sha256"]
    with pytest.raises(ShardlmError, match="differs in its weights"):
        provenance.check_base(first, provenance.base_identity(str(tmp_path), first), tmp_path)
    st = os.stat(tmp_path / "model.safetensors")  # a record whose name, size and mtime match is not re-read
    record = {**first, "weights": [{**first["weights"][0], "mtime_ns": st.st_mtime_ns}]}
    assert provenance.base_identity(str(tmp_path), record)["weights_sha256"] == first["weights_sha256"]


@pytest.mark.parametrize("case", ["targets", "head", "scratch", "adapter_of_full_run", "other_base", "alpha",
                                  "nf4_on_cpu"])
def test_lora_bad_input_one_line(lora_bases, lora_runs, case, corpus, cache_dir, tmp_path):
    from shardlm.inference.export import export

    folders, _ = lora_bases
    if case == "targets":
        args, expect = lora_args(corpus, cache_dir, tmp_path, folders["llama"], **{"lora.target_modules": "[qkv]"}), \
            r"\['qkv'\] match no linear layer .*: down_proj, gate_proj, k_proj, o_proj, q_proj"
    elif case == "head":  # PEFT would wrap it, but the chunked loss reads the head's weight: never trained
        args, expect = lora_args(corpus, cache_dir, tmp_path, folders["llama"],
                                 **{"lora.target_modules": "[q_proj,lm_head]"}), r"\['lm_head'\] match the output head"
    elif case == "scratch":
        args, expect = tiny(corpus, cache_dir, tmp_path, **{"lora.r": 4}), "model.name"
    elif case == "nf4_on_cpu":
        args, expect = lora_args(corpus, cache_dir, tmp_path, folders["llama"], **{
            "lora.quantize": "nf4", "lora.quant_backend": "bitsandbytes"}), "bitsandbytes needs a CUDA GPU.*torchao"
    elif case in ("other_base", "alpha"):
        run = tmp_path / "run"
        shutil.copytree(lora_runs["llama"], run)
        base, extra = (folders["llama_other"], {}) if case == "other_base" else (folders["llama"], {"lora.alpha": 64})
        args = lora_args(corpus, cache_dir, run, base, **{"train.max_steps": LORA_STEPS + 2, **extra})
        expect = ("trained on base model .* differs in its weights.*set model.name to the original base"
                  if case == "other_base" else "trained with lora.alpha=8.0, this run has lora.alpha=64")
    if case == "adapter_of_full_run":
        run = tmp_path / "full"
        train_in_process(tiny(corpus, cache_dir, run, **{"train.max_steps": 1}))
        with pytest.raises(ShardlmError, match="full fine-tuning checkpoint.*without --adapter") as err:
            export(run, tmp_path / "out", adapter=True)
        assert not (tmp_path / "out").exists()
    else:
        with pytest.raises(ShardlmError, match=expect) as err:
            train_in_process(args)
    if case in ("targets", "head", "other_base", "alpha"):  # `train --dry-run` makes the same checks
        from shardlm.config import load_config
        from shardlm.preflight.dryrun import dry_run

        with pytest.raises(ShardlmError, match=expect):
            dry_run(load_config(None, args), 1)
    assert "\n" not in str(err.value)  # the CLI prints a ShardlmError as one `error: ...` line (test_cli)
