"""Preference losses equal TRL's own on fixed log-probabilities: its CPO (sigmoid with label smoothing, SimPO) and
ORPO methods are called as they are; DPO and IPO, which TRL computes inside `DPOTrainer._compute_loss`, are
compared with the lines of that method (trl/trainer/dpo_trainer.py, "sigmoid" and "ipo")."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shardlm.objectives.preference.losses import pair_losses

g = torch.Generator().manual_seed(0)
CHOSEN, REJECTED = -torch.rand(6, generator=g) * 20 - 1, -torch.rand(6, generator=g) * 20 - 1
REF_C, REF_R = CHOSEN + torch.randn(6, generator=g), REJECTED + torch.randn(6, generator=g)
LEN_C, LEN_R = torch.tensor([3, 5, 8, 2, 9, 4]), torch.tensor([4, 4, 7, 6, 2, 3])


def test_dpo_and_ipo_are_trls():
    beta = 0.2
    delta = (CHOSEN - REF_C) - (REJECTED - REF_R)
    got = pair_losses("dpo", CHOSEN, REJECTED, LEN_C, LEN_R, REF_C, REF_R, beta=beta)
    assert torch.allclose(got.losses, -F.logsigmoid(beta * delta))
    assert torch.allclose(got.chosen_rewards, beta * (CHOSEN - REF_C))
    ipo_delta = (CHOSEN - REF_C) / LEN_C - (REJECTED - REF_R) / LEN_R
    got = pair_losses("ipo", CHOSEN, REJECTED, LEN_C, LEN_R, REF_C, REF_R, beta=beta)
    assert torch.allclose(got.losses, (ipo_delta - 1 / (2 * beta)) ** 2)


@pytest.mark.parametrize(("loss_type", "smoothing"), [("sigmoid", 0.1), ("simpo", 0.0), ("simpo", 0.2)])
def test_simpo_and_smoothed_sigmoid_are_trls_cpo(loss_type, smoothing):
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    beta, gamma = 2.0, 0.7
    me = SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=gamma, label_smoothing=smoothing, loss_type=loss_type,
                         accelerator=SimpleNamespace(device="cpu"))
    if loss_type == "simpo":  # CPO averages per token for SimPO (average_log_prob): give it the averages
        want = CPOTrainer.cpo_loss(me, CHOSEN / LEN_C, REJECTED / LEN_R)
        got = pair_losses("simpo", CHOSEN, REJECTED, LEN_C, LEN_R, beta=beta, label_smoothing=smoothing, gamma=gamma)
    else:  # cDPO: TRL's CPO sigmoid on log-ratios is DPO with label smoothing
        want = CPOTrainer.cpo_loss(me, CHOSEN - REF_C, REJECTED - REF_R)
        got = pair_losses("dpo", CHOSEN, REJECTED, LEN_C, LEN_R, REF_C, REF_R, beta=beta, label_smoothing=smoothing)
    assert torch.allclose(got.losses, want[0])
    assert torch.allclose(got.chosen_rewards, want[1]) and torch.allclose(got.rejected_rewards, want[2])


def test_orpo_is_trls():
    pytest.importorskip("trl")
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    me = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(me, CHOSEN / LEN_C, REJECTED / LEN_R)
    got = pair_losses("orpo", CHOSEN, REJECTED, LEN_C, LEN_R, beta=0.25)
    assert torch.allclose(got.losses, -losses)  # TRL subtracts its term from the NLL; shardlm adds the negation
    assert torch.allclose(got.chosen_rewards, chosen_rewards) and torch.allclose(got.rejected_rewards, rejected_rewards)


# ---- training on pairs ------------------------------------------------------------------------------------------
import json  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from faults import fault  # noqa: E402

from helpers import by_step, records, shardlm_cli, tiny  # noqa: E402
from shardlm import ShardlmError  # noqa: E402


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    """Conversational pairs (right vs wrong reversal) of uneven lengths, and a few text pairs' worth of variety."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    lines = []
    for _ in range(120):
        word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 7)))
        lines.append(json.dumps({"prompt": [{"role": "user", "content": f"Reverse: {word}"}],
                                 "chosen": [{"role": "assistant", "content": word[::-1]}],
                                 "rejected": [{"role": "assistant", "content": word + "x"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def pair_args(pairs_file, cache_dir, out, **extra):
    return ["train", *tiny(pairs_file, cache_dir, out, **{"model.chat_template": "chatml", "data.seq_len": 64,
                                                          "model.n_positions": 64, "train.objective": "dpo",
                                                          "train.max_steps": 6, "preference.beta": 0.5, **extra})]


@pytest.fixture(scope="module")
def dpo_one(pairs_file, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_one")
    shardlm_cli(pair_args(pairs_file, cache_dir, out, **{"train.batch_size": 4, "train.eval_every": 3}))
    return out


def test_dpo_two_ranks_train_what_one_process_trains_and_report_rewards(dpo_one, pairs_file, cache_dir, tmp_path):
    """The 2 ranks score against a live reference (a frozen copy of the initial model, sharded by FSDP2 as the
    policy is): the numbers of the one process's precomputed reference."""
    proc = shardlm_cli(pair_args(pairs_file, cache_dir, tmp_path, **{
        "train.batch_size": 1, "train.grad_accum": 2, "train.eval_every": 3, "preference.reference": "live"}), nproc=2)
    assert "reference: live, a frozen copy of the initial model (35,808 parameters, sharded as the policy)" in \
        proc.stdout + proc.stderr
    got, want = records(tmp_path), records(dpo_one)
    assert len(got) == len(want) == 6
    assert got[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # the policy is the reference at step 0
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"], a["rewards/margin"]) == pytest.approx(
            (b["loss"], b["grad_norm"], b["rewards/margin"]), rel=1e-4, abs=1e-7)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracy", "logps/chosen", "logps/rejected"} <= set(got[-1])
    val = records(tmp_path, "val")
    assert [r["loss"] for r in val] == pytest.approx([r["loss"] for r in records(dpo_one, "val")], rel=1e-4)
    assert got[-1]["loss"] < got[0]["loss"]
    # the console says what the pair numbers are (no `ppl`, which would read as exp(loss)), as eval prints them
    v = val[-1]
    line = (f"step 6: val loss {v['loss']:.4f} rewards/accuracy {v['rewards/accuracy']:.3f} rewards/margin "
            f"{v['rewards/margin']:.4f} (chosen {v['rewards/chosen']:.4f}, rejected {v['rewards/rejected']:.4f}) "
            f"on {v['pairs']} pairs, all {v['held_out_tokens']} held-out tokens")
    assert line in proc.stdout + proc.stderr and "ppl" not in proc.stdout + proc.stderr


def test_dpo_resume_is_exact_and_a_lost_reference_is_an_error(dpo_one, pairs_file, cache_dir, tmp_path):
    args = pair_args(pairs_file, cache_dir, tmp_path, **{"train.batch_size": 4, "train.eval_every": 3,
                                                         "checkpoint.every": 3})
    assert shardlm_cli([*args, fault("KillAfterSave(3)")], check=False).returncode != 0
    shardlm_cli(args)
    assert by_step(tmp_path) == by_step(dpo_one)  # the stored reference read back: bit for bit
    refs = list(cache_dir.glob("ex-*/reference-*.npy"))
    assert refs
    moved = [r.rename(r.with_suffix(".bak")) for r in refs]
    try:
        proc = shardlm_cli([*args, "train.max_steps=8"], check=False)
        assert proc.returncode == 2 and "the reference log-probabilities of this run" in proc.stderr
    finally:
        for r in moved:
            r.rename(r.with_suffix(".npy"))
    whole = {r: r.read_bytes() for r in refs}
    try:  # truncated (a full disk): named, not numpy's traceback
        for r, data in whole.items():
            r.write_bytes(data[: len(data) // 2])
        proc = shardlm_cli([*args, "train.max_steps=8"], check=False)
        error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(error) == 1 and "reference-" in error[0] and "is truncated" in error[0] \
            and "start over with checkpoint.resume=none" in error[0], proc.stderr
    finally:
        for r, data in whole.items():
            r.write_bytes(data)


def test_a_live_reference_resumes_exactly(dpo_one, pairs_file, cache_dir, tmp_path):
    """A resumed live run rebuilds the reference from the initial weights: the precomputed run's losses. Its
    state records their identity: a resume that would rebuild other weights (here another seed) is refused."""
    args = pair_args(pairs_file, cache_dir, tmp_path, **{"train.batch_size": 4, "train.eval_every": 3,
                                                         "checkpoint.every": 3, "preference.reference": "live"})
    assert shardlm_cli([*args, fault("KillAfterSave(3)")], check=False).returncode != 0
    shardlm_cli(args)
    got, want = by_step(tmp_path), by_step(dpo_one)
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)
    proc = shardlm_cli([*args, "train.max_steps=8", "train.seed=7"], check=False)  # another initial model
    assert proc.returncode == 2 and "preference.reference=live rebuilds the model this run started from" in proc.stderr


def test_the_stored_reference_is_the_models_own_log_probabilities(pairs_file, cache_dir, tmp_path):
    """Packed pairs, sequence ids and the segment sums give what the HF model scores for each answer alone."""
    from shardlm.config import load_config
    from shardlm.objectives.preference.pairs import prepare_reference, reference_source
    from shardlm.training.trainer import Trainer

    args = pair_args(pairs_file, cache_dir, tmp_path, **{"data.seq_len": 128, "model.n_positions": 128})[1:]
    trainer = Trainer.from_config(load_config(None, args))
    assert trainer.run.train.dropped == trainer.run.train.truncated == 0
    ref = prepare_reference(reference_source(trainer))["train"].double()
    hf, examples = trainer.model.hf.eval(), trainer.run.train.examples
    for pair in (0, 5, 17):
        for side in (0, 1):
            ids, mask = examples.example(2 * pair + side)
            with torch.no_grad():
                logits = hf(input_ids=torch.from_numpy(ids)[None]).logits[0, :-1].double()
            logps = torch.log_softmax(logits, -1).gather(1, torch.from_numpy(ids[1:])[:, None]).squeeze(1)
            assert ref[pair, side].item() == pytest.approx(logps[torch.from_numpy(mask[1:])].sum().item(), rel=1e-5)


def test_a_validation_tail_is_scored_by_the_reference_too(pairs_file, cache_dir, tmp_path):
    """Validation held out of the training pairs shares their reference file. At step 0 the policy is the
    reference: the validation loss is log 2 and every reward 0 (a zero reference for the tail would not be)."""
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config(None, pair_args(pairs_file, cache_dir, tmp_path)[1:]))
    got = trainer.evaluate()
    assert got["pairs"] > 0 and got["loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert got["rewards/chosen"] == got["rewards/rejected"] == got["rewards/margin"] == 0


def test_eval_scores_a_dpo_run_as_its_validation_did(dpo_one, capsys):
    """`shardlm eval RUN` on pairs: the run's objective against its reference, the numbers of its last validation."""
    from shardlm.inference.evaluate import evaluate_path
    from shardlm.objectives.preference.pairs import STATS

    got, want = evaluate_path(str(dpo_one), []), records(dpo_one, "val")[-1]
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1]) == got
    assert f"rewards/accuracy {got['rewards/accuracy']:.3f} rewards/margin" in out.err
    assert (got["pairs"], got["tokens"]) == (want["pairs"], want["tokens"])
    for key in ("loss", "accuracy", *STATS):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    live = evaluate_path(str(dpo_one), ["preference.reference=live"])  # scored in memory: the same numbers
    assert live["loss"] == pytest.approx(got["loss"], rel=1e-5)
    with pytest.raises(ShardlmError, match="the next-token loss does not score"):
        evaluate_path(str(dpo_one), ["train.objective=sft"])
    with pytest.raises(ShardlmError, match="--exact-match score text or answers"):
        evaluate_path(str(dpo_one), [], exact_match=2)


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}]},
     r"bad\.jsonl:2: a preference example needs 'chosen' and 'rejected'"),
    ({"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "ho"}, {"role": "assistant", "content": "b"}]},
     r"bad\.jsonl:2: 'chosen' and 'rejected' differ before their last assistant turn"),
    ({"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
     r"bad\.jsonl:2: 'chosen' and 'rejected' must both be text or both be lists"),
])
def test_bad_pairs_name_the_line(tmp_path, record, message):
    from shardlm.config import DataConfig
    from shardlm.data.examples import build_examples
    from shardlm.data.sources import resolve
    from shardlm.tokenizer import load_tokenizer, set_chat_template

    good = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    tok = load_tokenizer("bytes")
    set_chat_template(tok, "chatml")
    with pytest.raises(ShardlmError, match=message):
        build_examples(resolve(str(tmp_path / "bad.jsonl")), tok, DataConfig(), tmp_path / "cache", log=print)


def test_identical_sides_are_counted_and_sft_on_pairs_is_refused(tmp_path, cache_dir):
    pair = {"prompt": "Q: 1+1? A:", "chosen": " 2", "rejected": " 2"}
    (tmp_path / "same.jsonl").write_text((json.dumps(pair) + "\n") * 40)
    proc = shardlm_cli(["train", *tiny(tmp_path / "same.jsonl", cache_dir, tmp_path / "run", **{
        "train.objective": "dpo", "train.max_steps": 1, "train.batch_size": 2})], check=False)
    assert "40 pair(s) of" in proc.stderr + proc.stdout and "have the same chosen and rejected answer" in \
        proc.stderr + proc.stdout
    proc = shardlm_cli(["train", *tiny(tmp_path / "same.jsonl", cache_dir, tmp_path / "run2")], check=False)
    assert proc.returncode == 2 and "train.objective=sft does not train on" in proc.stderr


def test_a_lora_runs_reference_is_the_base_model(pairs_file, cache_dir, tmp_path):
    """With LoRA the reference is the base with the adapters off: at the first step the adapters add nothing, so
    the precomputed reference of a LoRA run equals the base model's own scores (no second copy of the weights).
    The live reference turns the adapters off: once they have moved, it still gives the base's scores."""
    from test_families import make_folder

    from shardlm.config import load_config
    from shardlm.objectives.preference.pairs import reference_source
    from shardlm.objectives.preference.reference import score_all
    from shardlm.training.trainer import Trainer

    base = make_folder(tmp_path, "llama")
    scores = []
    for lora in ({}, {"lora.r": 4, "lora.alpha": 8}):
        args = pair_args(pairs_file, cache_dir, tmp_path / f"run{len(scores)}", **{
            "model.name": base, "model.chat_template": "plain", "data.seq_len": 64, "preference.reference": "live",
            **lora})[1:]
        t = Trainer.from_config(load_config(None, [a for a in args if not a.startswith("model.n_")]))
        scores.append(score_all(t.model, t.run.train, t.dist, 4, t.autocast))
    assert np.count_nonzero(scores[0]) > 20
    assert np.allclose(scores[0], scores[1], rtol=1e-5, atol=1e-5)

    t.objective.prepare(reference_source(t))
    assert t.objective.frozen is None  # no copy: the policy itself, adapters off
    with torch.no_grad():
        for name, p in t.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    t.model.train()
    batch = t.run.train.batch(np.arange(6))
    live = t.objective.live_logps(t.model, batch, 2 * len(batch.units)).double().numpy()
    assert np.allclose(live, scores[0][batch.units.numpy()], rtol=1e-5, atol=1e-5)
    assert t.model.training  # and the adapters back on: the policy's own scores moved
    with torch.no_grad():
        policy, _ = t.model.sequence_logps(batch.inputs, batch.targets, batch.positions, batch.segments,
                                           2 * len(batch.units))
    assert not np.allclose(policy.view(-1, 2).double().numpy(), live, rtol=1e-3, atol=1e-3)


def _three_steps(args):
    """Losses and statistics of 3 training steps, then a validation, of a run built in this process."""
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config(None, args))
    steps = [trainer.train_step() for _ in range(3)]
    trainer.settle()
    got = [[float(s["loss_sum"]), s["grad_norm"], *s["stats"].tolist()] for s in steps]
    return trainer, np.array(got), trainer.evaluate()


def test_a_live_reference_trains_what_the_precomputed_one_does(pairs_file, cache_dir, tmp_path):
    """preference.reference=live (a frozen copy of the initial model scoring each micro-batch in the step) gives
    the precomputed reference's losses, gradient norms, rewards and validation, and stores nothing."""
    from shardlm.objectives.preference.pairs import Preference, reference_source

    extra = {"train.batch_size": 4, "train.grad_accum": 2, "train.eval_batches": 2}
    _, want, want_val = _three_steps(pair_args(pairs_file, cache_dir, tmp_path / "pre", **extra)[1:])
    live_cache = tmp_path / "cache"
    trainer, got, got_val = _three_steps(pair_args(pairs_file, live_cache, tmp_path / "live", **{
        **extra, "preference.reference": "live"})[1:])
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got_val["loss"] == pytest.approx(want_val["loss"], rel=1e-5)
    assert got_val["rewards/margin"] == pytest.approx(want_val["rewards/margin"], rel=1e-5, abs=1e-7)
    frozen = trainer.objective.frozen
    assert frozen is not None and not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert not list(live_cache.glob("**/reference-*.npy"))  # nothing beside the cache
    state = trainer.state_dict()
    assert state["reference_key"] == trainer.objective.key  # a resume checks it rebuilds this initial model
    resumed = Preference(trainer.cfg, trainer.device)
    resumed.resumed_key = "another base or seed"  # as a resume onto other initial weights reads it
    with pytest.raises(ShardlmError, match="preference.reference=live rebuilds the model this run started from"):
        resumed.prepare(reference_source(trainer))


def load_config_of(args):
    from shardlm.config import load_config

    return load_config(None, args)


def test_a_bad_reference_mode_is_refused():
    with pytest.raises(ShardlmError, match=r"preference.reference='livee' is not one of precomputed, live\. "
                                           r"Did you mean 'live'\?"):
        load_config_of(["preference.reference=livee"])


def test_the_stored_references_key_names_what_computes_its_scores(tmp_path):
    """QLoRA's 4-bit base scores other values than the full-precision base: a stored reference of one is not the
    other's. Settings that change no score keep the key (and a key from before quantization counted is kept)."""
    from types import SimpleNamespace

    from test_families import make_folder

    from shardlm.objectives.preference.reference import reference_key

    base = make_folder(tmp_path, "llama")

    def key(*overrides):
        return reference_key(SimpleNamespace(cfg=load_config_of([f"model.name={base}", *overrides]), hf_config=None))

    plain = key()
    assert key("lora.r=8") == plain  # a LoRA run's reference is its base
    assert key("lora.r=8", "lora.quantize=nf4") != plain
    assert key("lora.r=8", "lora.quantize=nf4", "lora.quant_backend=torchao") != \
        key("lora.r=8", "lora.quantize=nf4", "lora.quant_backend=bitsandbytes")  # other 4-bit values, other scores
    assert key("parallel.precision=bf16") != plain and key("data.seq_len=64") != plain
    assert key("train.lr=1e-3") == plain


def test_dpo_compiled_and_in_bf16_trains_what_eager_fp32_trains(pairs_file, cache_dir, tmp_path):
    """Pairs through the compiled model (the summed log-probabilities of each sequence, traced) and in bf16: the
    losses, gradient norms and rewards of eager fp32, within compile's and bf16's rounding; no recompile per step."""
    import torch

    extra = {"train.batch_size": 4, "train.eval_batches": 2}
    _, want, _ = _three_steps(pair_args(pairs_file, cache_dir, tmp_path / "eager", **extra)[1:])
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    _, compiled, _ = _three_steps(pair_args(pairs_file, cache_dir, tmp_path / "compiled", **{
        **extra, "parallel.compile": "model"})[1:])
    # the loss reads policy minus reference log-probabilities (sums over ~10 tokens, near equal at first): a
    # rounding difference of the traced sums shows there ~10x magnified, hence 3e-3 over 3 steps (SFT's: 1e-4)
    # (columns: loss, grad norm, rewards chosen/rejected/accuracy/margin, log-probabilities chosen/rejected; the
    # accuracy counts rewards > 0 and flips on rounding while the rewards are ~0, so it is left out)
    exact = [0, 1, 6, 7]
    assert np.allclose(compiled[:, exact], want[:, exact], rtol=3e-3)
    assert np.allclose(compiled[:, [2, 3, 5]], want[:, [2, 3, 5]], atol=1e-2)
    assert not counters["graph_break"] and sum(counters["recompiles"].values()) <= 1, dict(counters["recompiles"])
    _, bf16, _ = _three_steps(pair_args(pairs_file, cache_dir, tmp_path / "bf16", **{
        **extra, "parallel.precision": "bf16"})[1:])
    assert np.allclose(bf16[:, [0, 6, 7]], want[:, [0, 6, 7]], rtol=2e-2)  # bf16 matmuls
    assert np.isfinite(bf16).all()


def test_rpo_adds_the_chosen_answers_token_mean_cross_entropy_to_dpo(pairs_file, cache_dir, tmp_path):
    """TRL's rpo_alpha: loss = DPO + alpha x the chosen tokens' mean NLL. At the first step the policy is the
    reference (DPO = log 2 per pair), so the difference is alpha x -(summed chosen log-probs) / chosen tokens."""
    import math

    from shardlm.config import load_config
    from shardlm.objectives.preference.pairs import chosen_targets, pair_rows
    from shardlm.training.trainer import Trainer

    first = {}
    for alpha in (0.0, 0.5):
        trainer = Trainer.from_config(load_config(None, pair_args(pairs_file, cache_dir, tmp_path / str(alpha), **{
            "train.batch_size": 4, "preference.rpo_alpha": alpha})[1:]))
        tokens = chosen_targets(pair_rows(trainer.run.train, "training"),
                                trainer.sampler.indices(0, trainer.global_batch))
        s = trainer.train_step()
        pairs = s["targets"]
        first[alpha] = (float(s["loss_sum"]) / pairs, -s["stats"][4].item() / tokens)  # loss per pair, chosen NLL
    (dpo, nll), (rpo, _) = first[0.0], first[0.5]
    assert dpo == pytest.approx(math.log(2), rel=1e-5) and nll > 0.5
    assert rpo == pytest.approx(dpo + 0.5 * nll, rel=1e-5)
    with pytest.raises(ShardlmError, match="preference.rpo_alpha adds the chosen answers' cross-entropy to dpo"):
        load_config_of(pair_args(pairs_file, cache_dir, tmp_path, **{"train.objective": "simpo",
                                                                        "preference.rpo_alpha": 1.0})[1:])


def test_schedule_free_swaps_to_y_before_a_preference_forward():
    """`sequence_logps` is a forward of its own, which nn.Module's hooks do not see: schedule-free AdamW's swap of
    the weights to y must run before it as before `forward`, or every preference step would train at x."""
    from transformers import GPT2LMHeadModel

    from helpers import byte_gpt2_config
    from shardlm.models.causal_lm import CausalLM
    from shardlm.training.optim.variants import schedule_free_adamw

    torch.manual_seed(0)
    model = CausalLM(GPT2LMHeadModel(byte_gpt2_config()))
    optimizer = schedule_free_adamw(model, [{"params": list(model.parameters())}], lr=0.1)
    tokens = torch.randint(0, 256, (2, 16))
    segments = torch.arange(32).view(2, 16) // 8
    model(tokens, tokens)[0].backward()
    optimizer.step()  # x and y now differ; the step ends at x
    optimizer.zero_grad()
    model.eval()
    at_x, _ = model.sequence_logps(tokens, tokens, None, segments, 4)
    assert not optimizer.param_groups[0]["train_mode"]  # an evaluation stays at x
    model.train()
    at_y, _ = model.sequence_logps(tokens, tokens, None, segments, 4)
    assert optimizer.param_groups[0]["train_mode"]  # the training forward swapped to y first
    assert not torch.allclose(at_x, at_y)
