"""train.optimizer and train.schedule: each optimizer trains, 2 ranks (gloo processes) = 1 process, exact resume and
resume on another world size; Muon and Adafactor equal torch's own on one process; schedule-free evaluates and saves
its x; the schedules equal their formulas; a WSD run extended before (and after) its decay; bad input."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from helpers import by_step, records, shardlm_cli, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.training.optim import optimizers
from shardlm.training.schedule import (
    InverseSqrt,
    WarmupConstant,
    WarmupCosine,
    WarmupLinear,
    WarmupStableDecay,
    check_schedule,
    schedule_name,
)

# each optimizer at a learning rate it trains at in a few steps; adamw8bit on a width whose matrices quantize
OPTIMIZERS = {
    "muon": {},
    "adamw8bit": {"model.n_embd": 128, "model.vocab_multiple": 64},
    "adafactor": {"train.lr": 0.1},  # relative to each weight's RMS (~0.02 here)
    "schedule_free_adamw": {},
    "sgd": {"train.lr": 0.3},
}


def torchao_missing() -> str | None:
    """Why adamw8bit cannot run here: torchao is not installed (the lowest-torch venv: its releases shardlm takes
    need torch >= 2.10) or does not import; None where it runs."""
    from shardlm.training.optim.variants import import_problem

    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed (0.17 needs torch >= 2.10; this is {torch.__version__})"
    return import_problem("torchao.optim")


class Keep:
    """A callback that keeps the trainer (its run, optimizer and model) of an in-process run."""

    trainer = None

    def on_train_end(self, trainer, summary) -> None:
        Keep.trainer = trainer


def train_here(args: list[str]):
    from shardlm.runner import train

    keep = Keep()
    train(load_config(None, args), callbacks=[keep])
    return keep.trainer


def _ckpt(run, step: int):
    return run / "checkpoints" / f"step_{step:09d}"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_trains_shards_and_resumes_exactly(name, corpus, cache_dir, tmp_path, keep_signal_handlers):
    """Loss falls; 2 ranks = 1 process (Muon over 20 steps, each matrix orthogonalized whole by its owner rank);
    a resume is bit-exact on the same world size and equal to rounding on another."""
    if name == "adamw8bit" and (why := torchao_missing()):
        pytest.skip(why)
    steps = 20 if name == "muon" else 8
    half = steps // 2

    def args(out, **extra):
        return tiny(corpus, cache_dir, out, **{"train.optimizer": name, "train.max_steps": steps,
                                               "checkpoint.every": half, **OPTIMIZERS[name], **extra})

    trainer = train_here(args(tmp_path / "one"))
    one = by_step(tmp_path / "one")
    assert sorted(one) == list(range(1, steps + 1)) and one[steps] < one[1] - 0.3, one
    assert trainer.run.optimizer.shardlm_name == name

    shardlm_cli(["train", *args(tmp_path / "two", **{"train.batch_size": 4})], nproc=2)
    two = by_step(tmp_path / "two")
    assert two == pytest.approx(one, rel=1e-4)

    train_here(args(tmp_path / "resumed", **{"checkpoint.resume": _ckpt(tmp_path / "one", half)}))
    assert by_step(tmp_path / "resumed") == {s: one[s] for s in range(half + 1, steps + 1)}  # bit for bit

    train_here(args(tmp_path / "other", **{"checkpoint.resume": _ckpt(tmp_path / "two", half)}))  # 2 ranks -> 1
    assert by_step(tmp_path / "other") == pytest.approx({s: two[s] for s in range(half + 1, steps + 1)}, rel=1e-4)


def test_muon_groups_header_and_lora(corpus, cache_dir, tmp_path, keep_signal_handlers, lora_bases):
    """Muon takes the blocks' matrices (each group its own lr); embeddings, head, norms and biases go to AdamW; the
    header line names them. With LoRA it takes the adapter matrices, the only trainable matrices of the blocks."""
    from shardlm.training.build import describe_optimizer

    trainer = train_here(tiny(corpus, cache_dir, tmp_path / "a", **{"train.optimizer": "muon", "train.max_steps": 2,
                                                                     "train.muon_lr": 0.02}))
    groups = trainer.run.optimizer.groups_described
    assert [(g.label, g.tensors, g.lr) for g in groups] == [
        ("muon: block matrices", 8, 0.02), ("adamw: embeddings, head", 2, 3e-3), ("adamw: norms, biases", 18, 3e-3)]
    assert sum(g.params for g in groups) == trainer.n_params
    line, update = describe_optimizer(trainer.run).split("\n")
    assert line.startswith("optimizer: muon (muon: block matrices: 8 tensors, 24.6K parameters, lr 0.02; ") and \
        line.endswith("schedule: cosine to 0.1 x lr at step 2, 2 warmup steps")
    assert update == "update: synchronous clip-and-skip (Muon takes no clip factor or non-finite flag)"

    folders, _ = lora_bases

    def lora_args(out, **extra):
        return tiny(corpus, cache_dir, out, **{"model.name": folders["gpt2"], "lora.r": 4, "lora.alpha": 8,
                                               "train.optimizer": "muon", "train.max_steps": 4, "checkpoint.every": 2,
                                               **extra})

    lora = train_here(lora_args(tmp_path / "lora"))
    muon = lora.run.optimizer.param_groups[0]
    adapters = [p for n, p in lora.run.model.named_parameters() if "lora_" in n]
    assert muon["use_muon"] and {id(p) for p in muon["params"]} == {id(p) for p in adapters} and adapters
    losses = by_step(tmp_path / "lora")
    assert losses[4] < losses[1]
    # the frozen embeddings, norms and biases left two groups empty, which DCP could not load
    train_here(lora_args(tmp_path / "lora_resumed", **{"checkpoint.resume": _ckpt(tmp_path / "lora", 2)}))
    assert by_step(tmp_path / "lora_resumed") == {3: losses[3], 4: losses[4]}


def test_a_resume_runs_this_devices_implementation(corpus, cache_dir, tmp_path, keep_signal_handlers, monkeypatch):
    """A checkpoint's optimizer groups name the writer's implementation: an XLA run's (foreach) resumed on a CPU
    must run the CPU's fused kernel, whose sync-free step takes the clip factor (torch 2.9's foreach asserts on
    it), and continue with the writer's losses; the header says which update runs."""
    from shardlm.training.build import describe_optimizer
    from shardlm.training.optim import adamw

    def args(out, **extra):
        return tiny(corpus, cache_dir, out, **{"train.max_steps": 6, "checkpoint.every": 3, "train.grad_clip": 0.05,
                                               **extra})

    monkeypatch.setattr(optimizers, "fused_on", lambda device: False)  # the writer runs foreach, as on XLA
    writer = train_here(args(tmp_path / "writer"))
    assert writer.run.optimizer.param_groups[0]["foreach"]
    monkeypatch.undo()
    resumed = train_here(args(tmp_path / "resumed", **{"checkpoint.resume": _ckpt(tmp_path / "writer", 3)}))
    group = resumed.run.optimizer.param_groups[0]
    assert group["fused"] and not group["foreach"] and resumed.sync_free
    assert describe_optimizer(resumed.run).endswith(
        f"update: sync-free clip-and-skip in the optimizer (fused AdamW on cpu with torch {torch.__version__} takes "
        "the clip factor; the norm is read a step late)")
    written = by_step(tmp_path / "writer")
    assert by_step(tmp_path / "resumed") == pytest.approx({s: written[s] for s in (4, 5, 6)}, rel=1e-5)

    p = torch.nn.Parameter(torch.ones(2))  # the probe's answer is what torch does with the tensors
    p.grad = torch.ones(2)
    opt = torch.optim.AdamW([p], foreach=True)
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())  # type: ignore[attr-defined]
    try:
        opt.step()
    except AssertionError:  # torch 2.9-2.13's foreach kernel refuses them
        assert not adamw._probe("cpu", "foreach")
    assert adamw._probe("cpu", "fused")


def test_muon_and_adafactor_equal_torchs_own():
    """On plain tensors our Muon is torch.optim.Muon (Newton-Schulz in bf16 as torch's) and our Adafactor is
    torch.optim.Adafactor: the FSDP2 versions change where the math runs, not the math."""
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 40), (8, 8)]
    for ours_cls, theirs_cls in (("muon", torch.optim.Muon), ("adafactor", torch.optim.Adafactor)):
        a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        if ours_cls == "muon":
            ours = optimizers.Muon([{"params": a, "use_muon": True}], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1,
                                   momentum=0.95, adjust_lr="match_rms_adamw")
            ours.ns_dtype = torch.bfloat16
            theirs = theirs_cls(b, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
        else:
            ours = optimizers.Adafactor(a + [torch.nn.Parameter(torch.randn(7))], lr=1e-2, weight_decay=0.01)
            b.append(torch.nn.Parameter(ours.param_groups[0]["params"][-1].detach().clone()))
            a = ours.param_groups[0]["params"]
            theirs = theirs_cls(b, lr=1e-2, weight_decay=0.01, foreach=False)
        for _ in range(5):
            for p, q in zip(a, b, strict=True):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            ours.step()
            theirs.step()
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_schedule_free_evaluates_saves_and_exports_x(corpus, cache_dir, tmp_path, keep_signal_handlers):
    """Between steps the parameters are schedule-free's x (the average it evaluates); a training forward moves
    them to y. The final validation and the checkpoint (so `shardlm export`) are x's."""
    trainer = train_here(tiny(corpus, cache_dir, tmp_path, **{"train.optimizer": "sf_adamw", "train.max_steps": 6,
                                                               "train.eval_batches": 2}))
    opt, model = trainer.run.optimizer, trainer.run.model
    assert opt.param_groups[0]["train_mode"] is False
    x = [p.detach().clone() for p in model.parameters()]
    last_val = records(tmp_path, "val")[-1]["loss"]
    assert trainer.evaluate()["loss"] == pytest.approx(last_val, rel=1e-6)
    import torch.distributed.checkpoint as dcp

    key = "model.hf.transformer.wpe.weight"
    saved = {key: torch.empty_like(dict(model.named_parameters())["hf.transformer.wpe.weight"])}
    dcp.load(saved, checkpoint_id=str(_ckpt(tmp_path, 6)))
    assert torch.equal(saved[key], dict(model.named_parameters())["hf.transformer.wpe.weight"].detach())
    opt.train()  # y = x moved toward z: another point, another loss
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), x, strict=True))
    assert trainer.evaluate()["loss"] != pytest.approx(last_val, rel=1e-6)
    opt.eval()
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), x, strict=True))


def test_state_bytes_counted_and_estimated():
    """8-bit AdamW holds ~2 bytes per parameter (codes plus a scale per 256), Adafactor a row and a column per
    matrix; `state_bytes` reads what is held, `state_bytes_estimate` (estimate, tune) predicts it."""
    from transformers import GPT2LMHeadModel

    from helpers import byte_gpt2_config
    from shardlm.models.causal_lm import CausalLM

    torch.manual_seed(0)
    # the shapes of the adamw8bit run above (tiny(), width 128, vocabulary padded to 320): torchao's compiled update
    # is reused, not compiled again
    model = CausalLM(GPT2LMHeadModel(byte_gpt2_config(n_embd=128, n_layer=2, n_head=2, vocab_size=320)))
    held = {}
    for name in ("adamw", "adamw8bit", "adafactor", "muon", "sgd", "schedule_free_adamw"):
        if name == "adamw8bit" and torchao_missing():
            continue
        cfg = load_config(None, [f"train.optimizer={name}"])
        opt = optimizers.build_optimizer(model, cfg)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        held[name] = optimizers.state_bytes(opt)
        label, predicted = optimizers.state_bytes_estimate(cfg, model)
        assert predicted == pytest.approx(held[name], rel=0.02), (name, label)
    for p in model.parameters():
        p.grad = None
    assert "adamw8bit" not in held or held["adamw8bit"] / held["adamw"] < 0.3
    assert held["adafactor"] / held["adamw"] < 0.05 and held["sgd"] / held["adamw"] == pytest.approx(0.5, rel=0.01)


def test_schedules_equal_their_formulas():
    w, n, m = 10, 100, 0.1
    assert [WarmupCosine(w, n, m)(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    for s in (10, 37, 80, 99, 100, 150):
        p = min(1.0, (s - w) / (n - w))
        assert WarmupCosine(w, n, m)(s) == pytest.approx(m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p)))
        assert WarmupLinear(w, n, m)(s) == pytest.approx(m + (1 - m) * (1 - p))
        assert WarmupConstant(w, n, m)(s) == 1.0
        assert InverseSqrt(w, n, m)(s) == pytest.approx(max(m, math.sqrt(w / (s + 1))))
    for shape, f in (("1-sqrt", lambda p: 1 - math.sqrt(p)), ("linear", lambda p: 1 - p),
                     ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p)))):
        wsd = WarmupStableDecay(w, n, m, 0.2, shape)
        assert wsd.decay_start() == 80
        assert [wsd(s) for s in (4, 10, 50, 79)] == [0.5, 1.0, 1.0, 1.0]
        for s in (80, 85, 90, 99, 100):
            assert wsd(s) == pytest.approx(m + (1 - m) * f((s - 80) / 20))
    assert InverseSqrt(0, n, 0.0)(3) == pytest.approx(0.5)  # no warmup: timescale 1
    assert schedule_name("auto") == "cosine" and schedule_name("auto", "schedule_free_adamw") == "constant"
    assert schedule_name("warmup_stable_decay") == "wsd" and schedule_name("constant_with_warmup") == "constant"


def _lrs(out):
    return {r["step"]: r["lr"] for r in records(out)}


def test_wsd_extended_before_and_after_its_decay(corpus, cache_dir, tmp_path, keep_signal_handlers, capsys):
    """A WSD run resumed with a larger train.max_steps from a checkpoint of its stable phase stays at the peak and
    decays over the last decay_fraction of the new length; from one inside its decay, it continues the decay from
    the rate reached (no climb back) and says which checkpoint to take to keep the stable phase."""
    def args(out, steps, **extra):
        return tiny(corpus, cache_dir, out, **{"train.schedule": "wsd", "train.decay_fraction": 0.5,
                                               "train.decay_shape": "linear", "train.min_lr_ratio": 0.0,
                                               "train.max_steps": steps, "checkpoint.every": 4, "checkpoint.keep": 5,
                                               **extra})

    train_here(args(tmp_path / "first", 10))  # stable through step 4, decays over 5..10
    first = _lrs(tmp_path / "first")
    planned = WarmupStableDecay(2, 10, 0.0, 0.5, "linear")
    assert first == pytest.approx({s: 3e-3 * planned(s - 1) for s in range(1, 11)})
    capsys.readouterr()

    train_here(args(tmp_path / "stable", 20, **{"checkpoint.resume": _ckpt(tmp_path / "first", 4)}))
    assert "before its decay began: the learning rate stays at its peak until step 10" in capsys.readouterr().out
    longer = WarmupStableDecay(2, 20, 0.0, 0.5, "linear")
    assert _lrs(tmp_path / "stable") == pytest.approx({s: 3e-3 * longer(s - 1) for s in range(5, 21)})
    assert _lrs(tmp_path / "stable")[10] == 3e-3  # still the peak where the 10-step run was decaying

    train_here(args(tmp_path / "late", 20, **{"checkpoint.resume": _ckpt(tmp_path / "first", 8)}))
    out = capsys.readouterr().out
    assert "Its decay had begun at step 5: to train at the peak for longer instead, resume from a checkpoint " \
           "saved before step 5" in out
    late = _lrs(tmp_path / "late")
    reached = 3e-3 * planned(8)
    assert late[9] == pytest.approx(reached) and all(late[s + 1] < late[s] for s in range(9, 20))
    assert late[20] == pytest.approx(reached / 12, rel=1e-6)  # linear from step 8's rate to 0 at step 20

    with pytest.raises(ShardlmError, match=r"holds the state of train.optimizer=adamw, and this run asks for sgd: "
                                           r"resume with train.optimizer=adamw, or start a new run from its weights"):
        train_here(args(tmp_path / "other", 20, **{"checkpoint.resume": _ckpt(tmp_path / "first", 8),
                                                    "train.optimizer": "sgd"}))


def test_bad_input_is_one_line(corpus, cache_dir, tmp_path, monkeypatch, keep_signal_handlers):
    def error(*overrides: str, check=optimizers.check_optimizer) -> str:
        with pytest.raises(ShardlmError) as e:
            check(load_config(None, list(overrides)))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "Did you mean 'adamw8bit'?" in error("train.optimizer=adamw_8bti")
    assert optimizers.optimizer_name("adamw_torch_fused") == "adamw"
    assert optimizers.optimizer_name("ADAMW_BNB_8BIT") == "adamw8bit"
    assert "is AdamW's, not Muon's" in error("train.optimizer=muon", "train.optimizer_args={betas: [0.9, 0.99]}")
    assert "train.muon_lr applies to train.optimizer=muon" in error("train.muon_lr=0.02")
    assert "not an argument of train.optimizer=sgd" in error("train.optimizer=sgd", "train.optimizer_args={nestrov: 1}")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    assert "needs the torchao package, which is not installed: pip install torchao" in error(
        "train.optimizer=adamw8bit")
    monkeypatch.undo()
    if importlib.util.find_spec("torchao") is not None:  # installed, built for another torch (0.18 on torch 2.9)
        real_import = importlib.import_module

        def broken(name, *args):
            if name.startswith("torchao"):
                raise ImportError("cannot import name 'ScalingType' from 'torch.nn.functional'")
            return real_import(name, *args)

        monkeypatch.setattr(importlib, "import_module", broken)
        assert "needs the torchao package, which is installed but does not import with torch " \
               f"{torch.__version__} (ImportError: cannot import name 'ScalingType' from 'torch.nn.functional'): " \
               "install a torchao built for this torch (torchao 0.17 needs torch >= 2.10, 0.18 torch >= 2.11)" in error(
                   "train.optimizer=adamw8bit")
        monkeypatch.undo()

    def schedule(cfg):
        check_schedule(cfg.train, 30)

    assert "train.warmup_steps=50 exceeds the run's 30 steps" in error(
        "train.schedule=linear", "train.warmup_steps=50", check=schedule)
    assert "exceed the run's 30 steps" in error("train.schedule=wsd", "train.warmup_steps=28", check=schedule)
    assert "Did you mean 'cosine'?" in error("train.schedule=cosin", check=schedule)
    error("train.warmup_steps=50", check=lambda cfg: (check_schedule(cfg.train, 30), optimizers.check_optimizer(
        load_config(None, ["train.optimizer=nope"]))))  # auto allows a warmup longer than a smoke run
    proc = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path, **{"train.optimizer": "muon",
                                                                      "train.optimizer_args": "{eps: 1e-6}"})],
                       check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is AdamW's, not Muon's" in proc.stderr
