"""Memory controls: every activation-checkpointing mode trains as none does (fp32, loss and gradients), selective
recomputes no matmul; `parallel.wrap=size:N` forms the units its header names, keeps tied weights one parameter,
and 2 ranks resumed after a kill equal one process; bad modes and sizes are refused in one line."""

import contextlib
from collections import Counter

import pytest
import torch
from faults import fault
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import by_step, fp32_tol, on_cuda, shardlm_cli, tiny, train_in_process
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.training.trainer import Trainer

WRAPPED = "._checkpoint_wrapped_module"


def one_step(corpus, cache_dir, out, mode: str, **extra) -> tuple[float, dict[str, torch.Tensor], Counter]:
    """The loss and gradients of the first micro-batch, and the aten ops forward and backward ran (none counted
    when compiled: dynamo runs eagerly under a dispatch mode)."""
    torch.manual_seed(0)
    cfg = load_config(None, tiny(corpus, cache_dir, out, **{"parallel.activation_checkpointing": mode,
                                                            "model.dropout": 0.1, **extra}))
    trainer = Trainer.from_config(cfg)
    batch = trainer.train_batch(0)
    ops = OpCounter()
    with ops if extra.get("parallel.compile", "false") == "false" else contextlib.nullcontext():
        loss = trainer.forward_backward_step(batch).item()
    grads = {n.replace(WRAPPED, ""): p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.close()
    return loss, grads, ops.counts


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that really run: selective checkpointing's cached outputs never reach it."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def eager_none(corpus, cache_dir, tmp_path_factory):
    return one_step(corpus, cache_dir, tmp_path_factory.mktemp("none"), "none")


def assert_same(got, want):
    loss, grads, _ = got
    assert loss == pytest.approx(want[0], rel=1e-6)
    assert grads.keys() == want[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["full", "every:2", "selective", "offload", True])
def test_every_mode_trains_as_none(eager_none, corpus, cache_dir, tmp_path, mode):
    """With dropout: the recomputed masks must be the forward's (true: a config from before the modes)."""
    got = one_step(corpus, cache_dir, tmp_path, mode)
    assert_same(got, eager_none)
    matmuls = {op: n for op, n in got[2].items() if op in ("addmm", "mm", "bmm")}
    none_matmuls = {op: n for op, n in eager_none[2].items() if op in ("addmm", "mm", "bmm")}
    if mode in ("full", True):  # both blocks run their forward again: 4 more addmm each
        assert matmuls["addmm"] == none_matmuls["addmm"] + 2 * 4
    elif mode == "every:2":  # the second block only
        assert matmuls["addmm"] == none_matmuls["addmm"] + 4
    elif mode == "selective":  # no matmul again, but the pointwise ops (GELU, norms, dropout) are
        assert matmuls == none_matmuls
        assert sum(got[2].values()) > sum(eager_none[2].values())
        assert got[2]["gelu"] == 2 * eager_none[2]["gelu"]


def test_selective_and_offload_train_a_lora_llama_as_none(lora_bases, corpus, cache_dir, tmp_path):
    """Rotary embeddings, SwiGLU and PEFT's adapter layers (their matmuls kept too): only the adapters' gradients."""
    lora = {"model.name": lora_bases[0]["llama"], "lora.r": 4, "lora.alpha": 8}
    none = one_step(corpus, cache_dir, tmp_path / "none", "none", **lora)
    assert none[1] and all("lora_" in name for name in none[1])
    for mode in ("selective", "offload"):
        assert_same(one_step(corpus, cache_dir, tmp_path / mode, mode, **lora), none)


def test_selective_trains_dpo_pairs_with_a_live_reference_as_none(corpus, cache_dir, tmp_path):
    """Examples packed with their own positions, the pair's log-probabilities through sequence_logps, and a frozen
    reference built without checkpointing: the losses of two steps equal none's."""
    import json

    chat = [{"role": "user", "content": "Reverse: ab"}, {"role": "assistant", "content": "ba"}]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": [chat[0]], "chosen": [chat[1]], "rejected": [
        {"role": "assistant", "content": f"a{i}"}]}) + "\n" for i in range(40)))
    losses = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        trainer = Trainer.from_config(load_config(None, tiny(pairs, cache_dir, tmp_path / mode, **{
            "model.chat_template": "chatml", "data.seq_len": 64, "train.objective": "dpo",
            "preference.reference": "live", "parallel.activation_checkpointing": mode, "model.dropout": 0.1})))
        losses[mode] = [trainer.train_step()["loss_sum"].item() for _ in range(2)]
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-6)


@pytest.mark.cuda
def test_offload_on_a_gpu_moves_the_activations_and_trains_as_none(corpus, cache_dir, tmp_path):
    """Where there is a GPU (`pytest -m cuda`, gpu_check): the same loss and gradients, a lower peak on the device.
    Wider than tiny(), so the activations weigh more than the allocator's slack."""
    if not on_cuda():
        pytest.skip("offload keeps activations in CPU memory: on a CPU run they are there already")
    wide = {"model.n_embd": 256, "model.n_head": 4, "model.n_layer": 4, "train.batch_size": 16, "model.dropout": 0.0}
    peaks = {}
    for mode in ("none", "offload"):
        torch.cuda.reset_peak_memory_stats()
        got = one_step(corpus, cache_dir, tmp_path / mode, mode, **wide)
        peaks[mode] = torch.cuda.max_memory_allocated()
        if mode == "none":
            none = got
    loss, grads, _ = got
    assert loss == pytest.approx(none[0], rel=fp32_tol(1e-6))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, none[1][name], rtol=fp32_tol(1e-6), atol=1e-6, msg=name)
    assert peaks["offload"] < 0.8 * peaks["none"], peaks


@pytest.fixture(scope="module")
def eager_none_no_dropout(corpus, cache_dir, tmp_path_factory):
    return one_step(corpus, cache_dir, tmp_path_factory.mktemp("none"), "none", **{"model.dropout": 0.0})


@pytest.mark.parametrize("mode", ["selective"])  # full: test_compile; each compile costs 15-30 s here
def test_compiled_blocks_train_as_eager_none(eager_none_no_dropout, corpus, cache_dir, tmp_path, mode):
    """Without dropout: inductor draws its own random numbers."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = one_step(corpus, cache_dir, tmp_path, mode, **{"parallel.compile": "blocks", "model.dropout": 0.0})
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert_same(got, eager_none_no_dropout)


VIEWS = {"detach", "view", "_unsafe_view", "expand", "transpose", "split", "alias", "t", "permute", "slice",
         "select", "unsqueeze", "squeeze", "as_strided", "_reshape_alias"}  # no computation (checkpointing adds some)


def test_selective_recomputes_fewer_ops_than_full(eager_none, corpus, cache_dir, tmp_path):
    runs = {"none": eager_none[2], **{mode: one_step(corpus, cache_dir, tmp_path / mode, mode)[2]
                                      for mode in ("full", "selective")}}
    computed = {mode: sum(n for op, n in ops.items() if op not in VIEWS) for mode, ops in runs.items()}
    assert computed["none"] < computed["selective"] < computed["full"], computed


@pytest.mark.parametrize("overrides, message", [
    (["parallel.activation_checkpointing=selectve"], "is not one of none, full, every:N, selective, offload "
                                                     r"\(true = full, false = none\). Did you mean 'selective'"),
    (["parallel.activation_checkpointing=every:0"], "N of every:N is a whole number >= 1"),
    (["parallel.wrap=size:0"], "N of size:N is a number of parameters >= 1"),
    (["parallel.wrap=sized:10"], r"is not one of auto, block, blocks:K \(K blocks a unit\), size:N"),
    (["parallel.wrap=blocks:0"], "K of blocks:K is a whole number >= 1"),
])
def test_bad_modes_are_refused_with_the_config(overrides, message):
    with pytest.raises(ShardlmError, match=message):
        load_config(None, overrides)


SIZE = 4000  # the tiny model: attention 4,224, c_fc 4,224, MLP c_proj 4,128 parameters; a block 12,704
UNITS = ("FSDP2 units (parallel.wrap=size:4000): 7, each gathering its parameters: transformer.h.*.attn x2 of 4,224, "
         "transformer.h.*.mlp.c_fc x2 of 4,224, transformer.h.*.mlp.c_proj x2 of 4,128, root of 10,592")


def size_args(corpus, cache_dir, out, **extra):
    return tiny(corpus, cache_dir, out, **{"parallel.wrap": f"size:{SIZE}", "train.batch_size": 4,
                                           "checkpoint.every": 5, "parallel.activation_checkpointing": "selective",
                                           **extra})


def test_size_wrap_two_ranks_resumed_equal_one_process(corpus, cache_dir, tmp_path):
    """Units inside selectively checkpointed blocks (gathered again for their recompute); the tied embedding and
    head stay one parameter, in the root. Killed after the step-5 save and resumed, 2 ranks give one process's 10
    losses."""
    import torch.distributed.checkpoint as dcp

    train_in_process(size_args(corpus, cache_dir, tmp_path / "one", **{"train.batch_size": 8}))
    two = tmp_path / "two"
    killed = shardlm_cli(["train", *size_args(corpus, cache_dir, two), fault("KillAfterSave(5)")], nproc=2,
                         check=False)
    assert killed.returncode != 0 and UNITS in killed.stdout, killed.stdout
    resumed = shardlm_cli(["train", *size_args(corpus, cache_dir, two)], nproc=2)
    assert UNITS in resumed.stdout and "resum" in resumed.stdout.lower()
    want, got = by_step(tmp_path / "one"), by_step(two)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step
    saved = dcp.FileSystemReader(str(two / "checkpoints" / "step_000000010")).read_metadata().state_dict_metadata
    assert "model.hf.transformer.wte.weight" in saved and "model.hf.lm_head.weight" not in saved


BLOCKS = ("FSDP2 units (parallel.wrap=blocks:2): 3, each gathering its parameters: transformer.h.* (2 blocks) x2 of "
          "25,408, root of 10,336")


def test_grouped_blocks_two_ranks_equal_one_process(corpus, cache_dir, tmp_path):
    """4 blocks in 2 units of 2 (`fully_shard([a, b])`, one all-gather each, prefetched one from the other): 2 ranks
    give one process's losses, and the header names the units formed."""
    args = {"model.n_layer": 4, "parallel.wrap": "blocks:2", "train.batch_size": 4}
    train_in_process(tiny(corpus, cache_dir, tmp_path / "one", **{**args, "train.batch_size": 8}))
    two = shardlm_cli(["train", *tiny(corpus, cache_dir, tmp_path / "two", **args)], nproc=2)
    assert BLOCKS in two.stdout, two.stdout
    want, got = by_step(tmp_path / "one"), by_step(tmp_path / "two")
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step


def test_auto_groups_small_blocks_up_to_a_unit_and_leaves_large_ones_alone():
    from torch import nn

    from shardlm.distributed.wrapping import AUTO_UNIT_PARAMS, blocks_per_unit

    def blocks(n: int, params: int) -> nn.ModuleList:
        return nn.ModuleList(nn.Linear(params, 1, bias=False, device="meta") for _ in range(n))

    assert blocks_per_unit("auto", blocks(12, AUTO_UNIT_PARAMS // 7)) == 6  # 7 fit: 2 even units, not 7 + 5
    assert blocks_per_unit("auto", blocks(12, AUTO_UNIT_PARAMS // 100)) == 12  # tiny blocks: one unit
    assert blocks_per_unit("auto", blocks(32, AUTO_UNIT_PARAMS * 4)) == 1  # a 7B's blocks: one each
    assert blocks_per_unit("blocks:3", blocks(4, 10)) == 3 and blocks_per_unit("block", blocks(4, 10)) == 1
    assert blocks_per_unit("size:100", blocks(4, 10)) == 0


def test_units_keep_ties_and_a_size_that_forms_none_is_refused():
    from shardlm.distributed.parallelize import memory_notes
    from shardlm.distributed.wrapping import check_size, size_units
    from shardlm.models.hf_config import model_config
    from shardlm.models.instantiate import empty_model
    from shardlm.tokenizer import load_tokenizer

    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_positions=64",
                                 "data.seq_len=32"])
    hf = empty_model(model_config(cfg, load_tokenizer("bytes")), "meta")
    assert size_units(hf, 9000, whole_blocks=False)[0] == ["transformer.h.0", "transformer.h.1"]
    # compiled blocks: no unit inside one (the MLP alone would be), a block becomes one instead
    assert size_units(hf, SIZE, whole_blocks=True)[0] == ["transformer.h.0", "transformer.h.1"]
    # the tied embedding (8,224) is never a unit of its own, nor `transformer` without the head
    assert all("wte" not in u and u != "transformer" for u in size_units(hf, 2000, False)[0])
    notes = memory_notes(load_config(None, ["parallel.wrap=size:9000"]), torch.device("cpu"), use_fsdp=False)
    assert notes == ("note: parallel.wrap=size:9000 shapes FSDP2's units and this run has no FSDP (one process): it "
                     "changes nothing (parallel.fsdp=true shards one rank too).")
    with pytest.raises(ShardlmError, match=r"size:20000 forms no FSDP2 unit: .*'transformer.h.0', holds 12,704"):
        check_size(hf, 20000, False, "size:20000")


def test_a_size_that_forms_no_unit_is_refused_in_one_line(corpus, cache_dir, tmp_path, capsys):
    """By the dry run (in this process; the run's message is the same: parallelize makes the same check, and
    test_dryrun's catalogue has the config-level rows 165 and 166)."""
    from shardlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", *tiny(corpus, cache_dir, tmp_path / "run", **{"parallel.fsdp": True,
                                                                     "parallel.wrap": "size:20000"}), "--dry-run"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: parallel.wrap=size:20000 forms no FSDP2 unit: no module that can be one holds 20,000 parameters "
        "(the largest, 'transformer.h.0', holds 12,704), so all would stay in the root. Set N <= 12,704, or "
        "parallel.wrap=block (each block a unit).")
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as e:  # a size that forms units: the dry run names them as the run will
        main(["train", *tiny(corpus, cache_dir, tmp_path / "run", **{
            "parallel.fsdp": True, "parallel.wrap": "size:4000", "parallel.activation_checkpointing": "every:2"}),
              "--dry-run"])
    assert e.value.code == 0 and ("memory: activation checkpointing every:2 (1 of 2 blocks); 6 FSDP2 units of "
                                  "parallel.wrap=size:4000 and the root") in capsys.readouterr().out
