"""Beyond GPT-2: each family of `model.TESTED_FAMILIES` as a tiny random-weight pretrained folder (config,
safetensors, the byte tokenizer) built here, fine-tuned through the same path as a hub model.

What each family brings: Llama an untied head, no biases, RoPE, grouped-query attention; Qwen2 tied
embeddings and qkv biases; Mistral a sliding window (shorter than the sequence here); Gemma 2 scaled
embeddings, tied weights, attention and final-logit soft-capping (eager attention); Gemma 3 query/key
norms; Phi-3 fused qkv and gate/up projections; GPT-NeoX parallel residuals, partial rotary; OPT learned
positions with an offset, biases, tied weights. The mixture-of-experts families (Mixtral, Qwen2-MoE with a shared
expert, Qwen3-MoE, OLMoE, GPT-OSS with attention sinks) add their router's load-balancing loss to the
cross-entropy, as their config asks here (output_router_logits, coefficient 0.5); DeepSeek-V3 (shared experts,
latent attention, a dense first layer) adds none.
"""

import importlib.util
import json

import pytest
import torch

from helpers import generate_from_path, run_script, save_hf_folder, tiny
from shardlm import ShardlmError
from shardlm.config import load_config
from shardlm.models.attention import TESTED_FAMILIES
from shardlm.models.causal_lm import CausalLM
from shardlm.models.hf_config import model_config
from shardlm.models.instantiate import empty_model
from shardlm.tokenizer import byte_tokenizer

SMALL = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 4, "model.n_kv_head": 2,
         "model.intermediate_size": 64, "model.n_positions": 64, "data.seq_len": 32}
ROUTED = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.5}  # as a user sets it
EXTRA = {"qwen2": {"tie_word_embeddings": True}, "mistral": {"sliding_window": 16},
         "gemma2": {"sliding_window": 16}, "qwen3": {"tie_word_embeddings": False},
         "mixtral": {"num_local_experts": 4, **ROUTED},
         "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, **ROUTED},
         "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, **ROUTED},
         "olmoe": {"num_experts": 4, **ROUTED},
         "gpt_oss": {"num_local_experts": 4, "layer_types": ["sliding_attention", "full_attention"],
                     "sliding_window": 16, **ROUTED},
         "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                         "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                         "v_head_dim": 8, "num_key_value_heads": 4}}


def make_folder(root, arch):
    folder = root / arch
    overrides = [f"{k}={v}" for k, v in SMALL.items()] + [f"model.arch={arch}", "model.tokenizer=bytes",
                                                          f"model.config_overrides={json.dumps(EXTRA.get(arch, {}))}"]
    hf_cfg = model_config(load_config(None, overrides), byte_tokenizer())
    torch.manual_seed(0)
    return save_hf_folder(empty_model(hf_cfg, "cpu"), folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: make_folder(root, arch) for arch in TESTED_FAMILIES}


@pytest.mark.parametrize("arch", TESTED_FAMILIES)
def test_loss_is_the_models_own_and_ties_are_kept(folders, arch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).train()
    tokens = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].contiguous()  # routers see the inputs alone, as in training
    want = hf(input_ids=inputs, labels=inputs, shift_labels=targets).loss  # + router_aux_loss_coef x aux (MoE)
    assert getattr(hf.config, "output_router_logits", False) == ("output_router_logits" in EXTRA.get(arch, {}))
    chunks = [0] if arch == "gemma2" else [0, 16]  # gemma2 soft-caps its logits: the model's own logits only
    for chunk in chunks:
        loss_sum, _ = CausalLM(hf, chunk).train()(inputs, targets)
        assert (loss_sum / targets.numel()).item() == pytest.approx(want.item(), rel=1e-6), chunk
    tied = hf.config.tie_word_embeddings
    assert (hf.get_output_embeddings().weight is hf.get_input_embeddings().weight) == tied


def test_fsdp_equals_one_process_resumes_exactly_and_exports_for_every_family(folders, corpus, cache_dir, tmp_path):
    """Family by family: 2-rank FSDP `full` trains what one process trains (accumulating the same micro-batches);
    ties survive sharding; resuming the 2-rank checkpoint of step 3 repeats steps 4-6 exactly; its export loads in
    `transformers.pipeline` and greedy text equals `shardlm generate`'s."""
    from transformers import AutoConfig, pipeline

    from shardlm.inference.export import export

    overrides = [a for a in tiny(corpus, cache_dir, tmp_path) if a.split("=")[0] not in
                 {"model.n_layer", "model.n_embd", "model.n_head", "model.n_positions", "out_dir"}]
    overrides += ["model.dropout=0.0", "data.seq_len=32"]

    def run(nproc: int, batch: int, *flags: str, accum: int = 1) -> dict:
        out = run_script("family_losses.py", f"run{nproc}", *flags, *map(str, folders.values()), "--", *overrides,
                         f"train.batch_size={batch}", f"train.grad_accum={accum}", nproc=nproc, timeout=600)
        return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))

    # 1 process accumulates the ranks' two micro-batches: a router's load-balancing loss is a statistic of each
    # forward's batch (as in the model's own forward), so a batch of 4 rows would be another objective than 2 x 2
    sharded, single = run(2, 2, "--resume"), run(1, 2, accum=2)
    for arch, folder in folders.items():
        got, want = sharded[str(folder)], single[str(folder)]
        assert got["tied"] == want["tied"] == AutoConfig.from_pretrained(folder).tie_word_embeddings, arch
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-4), arch
        assert got["losses"][-1] < got["losses"][0], arch
        assert got["resumed"] == got["losses"][3:], arch  # exact
        run_dir, hf_dir = f"{folder}-run2", tmp_path / f"{arch}-hf"
        export(run_dir, hf_dir)
        ours = generate_from_path(run_dir, "To be", 8, temperature=0)[0]
        theirs = pipeline("text-generation", model=str(hf_dir))("To be", do_sample=False, max_new_tokens=8)
        assert theirs[0]["generated_text"] == ours, arch


def test_the_models_own_tokenizer_by_default(folders, tmp_path):
    """A GPT-2-vocabulary folder: unset model.tokenizer loads the folder's BPE tokenizer; bytes is refused
    (it used to train the BPE model on byte ids without a word)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.tokenizer import load_tokenizer, model_tokenizer

    folder = tmp_path / "bpe"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, n_positions=64)).save_pretrained(folder)
    load_tokenizer("gpt2").save_pretrained(folder)
    cfg = load_config(None, [f"model.name={folder}", "data.seq_len=64"])
    tokenizer = model_tokenizer(cfg.model)
    assert len(tokenizer) == 50257 and model_config(cfg, tokenizer).vocab_size == 50257
    bytes_cfg = load_config(None, [f"model.name={folder}", "model.tokenizer=bytes", "data.seq_len=64"])
    with pytest.raises(ShardlmError, match="is not the tokenizer of model .* end-of-text id is 256, the model's is "
                                           "50256. Leave model.tokenizer unset"):
        model_config(bytes_cfg, model_tokenizer(bytes_cfg.model))
    with pytest.raises(ShardlmError, match="model.arch='lama' is not a causal LM family.*Did you mean 'llama'"):
        model_config(load_config(None, ["model.arch=lama"]), byte_tokenizer())
    with pytest.raises(ShardlmError, match="flex_attention: GPT2LMHeadModel does not support it"):
        model_config(load_config(None, ["model.attention=flex_attention"]), byte_tokenizer())
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ShardlmError, match="model.attention=flash_attention_2 needs the flash_attn package"):
            model_config(load_config(None, ["model.attention=flash_attention_2"]), byte_tokenizer())
    with pytest.raises(ShardlmError, match="transforms its logits"):
        model_config(load_config(None, [f"model.name={folders['gemma2']}", "train.loss_chunk_size=16",
                                        "data.seq_len=32"]),
                     byte_tokenizer())


def test_rope_scaling_fine_tunes_at_4x_the_context_and_the_export_carries_it(folders, corpus, cache_dir, tmp_path):
    """Llama's 64 positions stretched to 256 (linear interpolation): trains, and the
    export's config carries the scaling, so transformers computes the trained model's logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardlm.inference.export import export
    from shardlm.training.trainer import Trainer

    overrides = tiny(corpus, cache_dir, tmp_path / "run", **{
        "model.name": folders["llama"], "model.rope_scaling": "{type: linear, factor: 4}", "data.seq_len": 256,
        "train.batch_size": 2, "train.max_steps": 2, "model.dropout": 0.0})
    overrides = [o for o in overrides if o.split("=")[0] not in {"model.n_layer", "model.n_embd", "model.n_head",
                                                                   "model.n_positions"}]
    trainer = Trainer.from_config(load_config(None, overrides), checkpoint=True)
    trainer.fit()
    export(tmp_path / "run", tmp_path / "hf")
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    scaling = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert (scaling["rope_type"], scaling["factor"], config.max_position_embeddings) == ("linear", 4.0, 256)
    tokens = torch.randint(0, 257, (1, 256), generator=torch.Generator().manual_seed(1))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(tokens).logits
    with torch.no_grad():
        ours = trainer.model.eval().hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_pretrained_overrides_that_keep_shapes_apply_and_others_are_refused(folders):
    def config(arch: str, *extra: str):
        return model_config(load_config(None, [f"model.name={folders[arch]}", "data.seq_len=32", *extra]),
                            byte_tokenizer())

    assert config("mixtral", "model.config_overrides={output_router_logits: false}").output_router_logits is False
    assert config("mistral", "model.config_overrides={sliding_window: 8}").sliding_window == 8
    with pytest.raises(ShardlmError, match="train.objective=dpo on a mixture-of-experts model whose config adds the "
                                           "router's load-balancing loss"):
        config("mixtral", "train.objective=dpo")
    assert not config("mixtral", "train.objective=dpo",
                      "model.config_overrides={output_router_logits: false}").output_router_logits
    with pytest.raises(ShardlmError, match=r"model.config_overrides intermediate_size would change the pretrained "
                                           r"weights' shapes \(model.layers.0.mlp.down_proj.weight: \(32, 64\) -> "):
        config("llama", "model.config_overrides={intermediate_size: 128}")
    with pytest.raises(ShardlmError, match="has no config field 'sliding_windw'. Did you mean 'sliding_window'"):
        config("mistral", "model.config_overrides={sliding_windw: 8}")
    with pytest.raises(ShardlmError, match="model.rope_scaling: gpt2 has no rotary position embeddings"):
        config("gpt2", "model.rope_scaling={type: linear, factor: 2}")
    with pytest.raises(ShardlmError, match=r"data.seq_len=256 exceeds the model's 64 positions; set data.seq_len<=64,"
                                           r" or stretch its context with model.rope_scaling='\{type: yarn, factor: 4"):
        config("qwen3", "data.seq_len=256")
    with pytest.raises(ShardlmError, match="model.rope_scaling needs type: one of linear, dynamic, yarn"):
        config("llama", "model.rope_scaling={type: ntk, factor: 2}")


def test_moe_records_carry_the_router_loss_and_expert_load_and_plot_draws_them(folders, corpus, cache_dir, tmp_path,
                                                                                 capsys):
    from helpers import records
    from shardlm.observe.plot import plot_runs
    from shardlm.runner import train

    overrides = [o for o in tiny(corpus, cache_dir, tmp_path / "run", **{
        "model.name": folders["mixtral"], "train.max_steps": 4, "train.log_every": 2, "model.dropout": 0.0})
        if o.split("=")[0] not in {"model.n_layer", "model.n_embd", "model.n_head", "model.n_positions"}]
    train(load_config(None, [*overrides, "data.seq_len=32"]))
    header = capsys.readouterr().out
    assert "active per token (mixture of experts: " in header and "top-2 of 4)" in header, header
    rec = [r for r in records(tmp_path / "run") if r["split"] == "train"]
    assert [r["step"] for r in rec] == [2, 4]
    for r in rec:
        assert r["router_aux_loss"] >= 1.9  # top-2 of 4 experts: 2 when balanced, more when not
        assert 0 <= r["expert_load_min"] <= 1 <= r["expert_load_max"] and r["expert_load_cv"] >= 0
        assert len(r["expert_load_cv_by_layer"]) == 2
        assert max(r["expert_load_cv_by_layer"]) == pytest.approx(r["expert_load_cv"], abs=1e-4)
    drawn = {p.name for p in plot_runs([str(tmp_path / "run")], str(tmp_path / "plots"))}
    assert {"expert_load.png", "router_aux_loss.png"} <= drawn


def test_a_bidirectional_encoder_is_refused_and_trains_causally_when_its_config_says_decoder(tmp_path):
    """AutoModelForCausalLM builds BERT with a next-token head but a bidirectional mask: every position would see
    the token it predicts (a loss near zero). Refused, unless is_decoder makes its attention causal, which the
    logits show: changing a later token leaves the earlier positions' logits as they were."""
    from transformers import AutoModelForCausalLM, BertConfig

    folder = tmp_path / "bert"
    tiny = {"vocab_size": 259, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 32, "max_position_embeddings": 64}
    AutoModelForCausalLM.from_config(BertConfig(**tiny)).save_pretrained(folder)
    with pytest.raises(ShardlmError, match=r"model family 'bert' is a bidirectional encoder \(is_decoder=false\).*"
                                           r"config_overrides='\{\"is_decoder\": true\}'"):
        model_config(load_config(None, [f"model.name={folder}", "model.tokenizer=bytes", "data.seq_len=32"]),
                     byte_tokenizer())
    with pytest.raises(ShardlmError, match="'bert' is a bidirectional encoder"):
        model_config(load_config(None, ["model.arch=bert"]), byte_tokenizer())
    decoder = model_config(load_config(None, [f"model.name={folder}", "model.tokenizer=bytes", "data.seq_len=32",
                                              'model.config_overrides={"is_decoder": true}']), byte_tokenizer())
    model = AutoModelForCausalLM.from_config(decoder).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    changed = ids.clone()
    changed[0, -1] = 9
    with torch.no_grad():
        assert torch.equal(model(ids).logits[0, :3], model(changed).logits[0, :3])
