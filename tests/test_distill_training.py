"""Distillation in the loop (`train.objective=distill`, shardlm.objectives.distill.step and teacher): the step's loss
is GKD's generalized JSD to the teacher mixed with the next-token loss, exactly as the whole-logits reference gives
it (alpha 0: sft's loss; a teacher equal to the student: no divergence); the teacher, a Llama folder whose head has
padding rows, stays frozen and outside the optimizer and the checkpoint; 2 ranks train what one process trains,
a killed run resumes to the same numbers and refuses another teacher; the records are plotted; the export is the
student."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from faults import fault

from helpers import by_step, fp32_tol, records, shardlm_cli, tiny, train_in_process
from shardlm import ShardlmError
from shardlm.tokenizer import byte_tokenizer, set_chat_template


def save_teacher(folder: Path, seed: int, chatml: bool = False) -> Path:
    """A 2-layer Llama over the byte tokenizer (with ChatML's two tokens if asked), its head 264 rows: the
    tokenizer's and padding rows. Initialized wide enough that its next-token distributions are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    if chatml:
        set_chat_template(tok, "chatml")
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=264, max_position_embeddings=64, bos_token_id=256,
                                 eos_token_id=256, initializer_range=0.3)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def distill_args(corpus, cache_dir, out, teacher, **extra) -> list[str]:
    return tiny(corpus, cache_dir, out, **{"train.objective": "distill", "distill.teacher": teacher, **extra})


@pytest.mark.cuda
def test_the_step_is_gkds_loss_to_the_teacher(corpus, cache_dir, tmp_path):
    """One step through the Trainer, in chunks of 48 positions: its loss sum and divergence are the whole-logits
    reference's on the same micro-batch, over the tokenizer's 257 rows (the teacher's padding rows left out); at
    alpha 0 it is sft's loss. The teacher gets no gradient and no optimizer state. A student that is the teacher
    (the same folder) starts with no divergence at all."""
    from shardlm.config import load_config
    from shardlm.models.distill_loss import full_distill_loss
    from shardlm.training.trainer import Trainer

    teacher, tol = save_teacher(tmp_path / "teacher", seed=0), fp32_tol(1e-5)
    for alpha in (0.6, 0.0):
        cfg = load_config(None, distill_args(corpus, cache_dir, tmp_path / f"run{alpha}", teacher, **{
            "distill.beta": 0.3, "distill.temperature": 2.0, "distill.alpha": alpha, "train.loss_chunk_size": 48,
            "train.batch_size": 4}))
        trainer = Trainer.from_config(cfg)
        assert trainer.objective is not None and trainer.objective.teacher is not None
        student, frozen = trainer.model, trainer.objective.teacher
        batch = trainer.train_batch(0)
        with torch.no_grad():
            want, parts = full_distill_loss(student.hf(batch.inputs).logits, frozen.hf(batch.inputs).logits,
                                            batch.targets, beta=0.3, temperature=2.0, alpha=alpha, vocab=257)
            sft, _ = student(batch.inputs, batch.targets)
        result = trainer.train_step()
        assert float(result["loss_sum"]) == pytest.approx(float(want), rel=tol)
        assert result["targets"] == batch.targets.numel()
        assert result["stats"] is not None and float(parts["distill"]) > 1.0
        assert float(result["stats"][0]) == pytest.approx(float(parts["distill"]), rel=tol)
        assert float(result["stats"][1]) == pytest.approx(float(sft), rel=tol)  # distill/nll: the student's own
        if alpha == 0:
            assert float(result["loss_sum"]) == pytest.approx(float(sft), rel=tol)
        optimized = {id(p) for group in trainer.run.optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for p in student.parameters()}
        assert all(p.grad is None and not p.requires_grad and id(p) not in optimized for p in frozen.parameters())
        assert not frozen.training
    cfg = load_config(None, distill_args(corpus, cache_dir, tmp_path / "same", teacher, **{
        "model.name": teacher, "train.batch_size": 4}))
    result = Trainer.from_config(cfg).train_step()
    assert result["stats"] is not None and abs(float(result["stats"][0])) < 1e-4 < float(result["stats"][1])


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory) -> Path:
    """Prompt/completion records of uneven lengths: several packed to a row, the loss on the answers alone."""
    rng = random.Random(0)
    lines = []
    for _ in range(96):
        word = "".join(rng.choice("abcdefg") for _ in range(rng.randint(1, 6)))
        lines.append(json.dumps({"prompt": f"Reverse {word}:", "completion": f" {word[::-1]}"}))
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_ranks_and_a_resume_train_what_one_process_trains(qa_file, cache_dir, tmp_path):
    """Examples (answers-only targets, packed), beta 0.5, alpha 0.8: 2 ranks x 1 row x 2 accumulated micro-batches
    give one process's losses and records (its teacher sharded by FSDP2 as the student); a run killed after its
    step-3 checkpoint resumes to the uninterrupted numbers, and refuses to go on with another teacher. The checkpoint
    holds no teacher weight; the export is the student and generates."""
    teacher = save_teacher(tmp_path / "teacher", seed=0, chatml=True)

    def args(out, **extra):
        return ["train", *distill_args(qa_file, cache_dir, out, teacher, **{
            "model.chat_template": "chatml", "data.seq_len": 48, "model.n_positions": 48, "train.max_steps": 6,
            "train.eval_every": 3, "distill.alpha": 0.8, **extra})]

    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    shardlm_cli(args(one, **{"train.batch_size": 4}))
    proc = shardlm_cli(args(two, **{"train.batch_size": 1, "train.grad_accum": 2}), nproc=2)
    assert "frozen, sharded as the student" in proc.stdout + proc.stderr
    keys = ("loss", "distill/loss", "distill/nll", "distill/teacher_entropy", "distill/student_entropy")
    for split in ("train", "val"):
        got, want = records(two, split), records(one, split)
        assert len(got) == len(want) == (6 if split == "train" else 2)
        for a, b in zip(got, want, strict=True):
            assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5)
    first, last = records(one)[0], records(one)[-1]
    assert last["loss"] < first["loss"] and first["distill/on_policy"] == 0
    assert first["loss"] == pytest.approx(0.8 * first["distill/loss"] + 0.2 * first["distill/nll"], rel=1e-5)
    from shardlm.observe.plot import plot_runs

    written = {p.name for p in plot_runs([str(one)], str(tmp_path / "plots"), log=lambda _: None)}
    assert {"distill_loss.png", "distill_entropy.png"} <= written

    run = args(resumed, **{"train.batch_size": 4, "checkpoint.every": 3})
    assert shardlm_cli([*run, fault("KillAfterSave(3)")], check=False).returncode != 0
    shardlm_cli(run)
    got, want = by_step(resumed), by_step(one)
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), rel=1e-6)
    other = save_teacher(tmp_path / "other", seed=1, chatml=True)
    with pytest.raises(ShardlmError, match="is not the teacher this run trained with"):
        train_in_process([*run[1:], "train.max_steps=8", f"distill.teacher={other}"])

    ckpt = max((resumed / "checkpoints").glob("step_*"))
    saved = list(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert any(".transformer.h." in k for k in saved) and not any(".layers." in k for k in saved)  # Llama's
    from transformers import AutoModelForCausalLM

    from shardlm.inference.export import export

    export(resumed, tmp_path / "hf")

    student = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert student.config.model_type == "gpt2" and student.config.n_layer == 2
    out = student.generate(torch.tensor([[82, 101]]), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 7)


def test_a_run_folder_teacher_its_stored_top_k_and_on_policy_steps(qa_file, cache_dir, tmp_path):
    """A teacher that is a shardlm run folder (its newest checkpoint). Its top-K scores stored with K = the whole
    vocabulary give the live teacher's step, addressed by the rows the sampler drew; an on-policy step trains on the
    student's own samples alone; a student whose tokenizer lacks ChatML's tokens is refused in one line."""
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    teacher = tmp_path / "teacher_run"
    shape = {"model.chat_template": "chatml", "data.seq_len": 48, "model.n_positions": 48}
    train_in_process(tiny(qa_file, cache_dir, teacher, **shape, **{"train.max_steps": 2, "model.n_embd": 48}))

    def step(out: str, **extra):
        args = distill_args(qa_file, cache_dir, tmp_path / out, teacher, **{**shape, "train.batch_size": 4, **extra})
        return Trainer.from_config(load_config(None, args)).train_step()

    live, stored = step("live"), step("topk", **{"distill.teacher_topk": 259})
    assert live["targets"] == stored["targets"] and live["stats"] is not None and stored["stats"] is not None
    assert float(stored["loss_sum"]) == pytest.approx(float(live["loss_sum"]), rel=1e-5)
    assert stored["stats"][:2].tolist() == pytest.approx(live["stats"][:2].tolist(), rel=1e-5)
    sampled = step("on_policy", **{"distill.on_policy": 1.0, "distill.max_new_tokens": 6})
    assert sampled["stats"] is not None and float(sampled["stats"][4]) == sampled["targets"] != live["targets"]
    with pytest.raises(ShardlmError, match="does not share the student's tokenizer .*'<.im_start.>': absent in the "
                                           "student's 257 tokens, 257 in the teacher's 259"):
        step("plain", **{"model.chat_template": "plain"})
