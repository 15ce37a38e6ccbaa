"""`shardlm eval PATH [data.val=...] [--stride S]`: loss, perplexity and accuracy of a saved model.

Everything is scored by training's own evaluation (shardlm.objectives.validate: the Validator, through `CausalLM`),
so a family's logit transform (Gemma 2's soft-capping, Cohere's and Granite's scaling) counts as in the run's
validation. Block mode scores the same packed blocks training validates on. `--stride` is the sliding-window
protocol used for published GPT-2 perplexities: windows of the model's context advance by `stride` tokens and
only the tokens not scored by an earlier window count, each with up to a full context before it.

Preference pairs are scored as the run's validation scores them (`evaluate_pairs`: the run's objective and
settings, against the run's reference): loss, rewards/* and logps/*.

`--generation N` adds generation quality (shardlm.inference.genquality) on N held-out prompts: in the JSON line under
"generation" and, for a run, as a `"split": "gen"` record in its metrics.jsonl at the checkpoint's step.

Progress goes to stderr (a bar on a terminal, else a line after the first batch and every ~10 s); stdout
carries only the final JSON line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.checkpoint.layout import metrics_file, read_config, read_manifest, run_dir_of
from shardlm.checkpoint.load import inference_config, load_for_inference
from shardlm.config import Config, LoraConfig, build_config, objectives, parse_overrides, to_flat_dict
from shardlm.data import Batch, Blocks, ExampleRows, TokenBlocks
from shardlm.data.examples import ExampleSet
from shardlm.data.mixture import MixtureBlocks
from shardlm.distributed.process_group import Dist, LaunchInfo
from shardlm.inference.genquality import (
    FEW_FOR_MAUVE,
    MODULES,
    generation_quality,
    held_out_prompts,
    record_fields,
    require,
)
from shardlm.models import lora
from shardlm.models.causal_lm import auto_loss_chunk
from shardlm.models.hf_config import context_length, model_config
from shardlm.models.loss import IGNORE
from shardlm.objectives import objective_family
from shardlm.objectives.rl.step import evaluate_prompts
from shardlm.objectives.validate import TokenScores, Validator, scoring_model
from shardlm.observe.metrics import describe_val
from shardlm.observe.progress import EvalProgress


def evaluate_blocks(model, blocks: Blocks, batch: int, max_batches: int, chunk: int) -> dict:
    """Text blocks or example rows (their target tokens only), scored as training validates them."""
    lm = scoring_model(model, chunk)
    n = len(blocks) if max_batches == 0 else min(len(blocks), max_batches * batch)
    progress = EvalProgress(blocks.targets(np.arange(n)), -(-n // batch))
    validator = Validator(_one_process(lm), batch, max_batches, on_batch=progress.update)
    result = validator.validate(lm, blocks, TokenScores())
    progress.close()
    return result | {"held_out_tokens": blocks.target_tokens}


class Windows:
    """`--stride`'s sliding windows as rows the Validator reads, one window a batch: windows of `context` tokens
    advance by `stride`, and each scores only the targets no earlier window scored."""

    def __init__(self, tokens: np.ndarray, context: int, stride: int):
        self.stream = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        last = len(self.stream) - 1
        self.spans: list[tuple[int, int, int]] = []  # (begin, end, fresh targets)
        prev_end = 0
        for begin in range(0, last, stride):
            end = min(begin + context, last)
            self.spans.append((begin, end, end - max(prev_end, begin)))
            prev_end = end
            if end == last:
                break

    def __len__(self) -> int:
        return len(self.spans)

    def batch(self, indices: np.ndarray) -> Batch:
        (begin, end, fresh), = (self.spans[int(i)] for i in indices)
        window = self.stream[begin:end + 1]
        targets = window[1:].clone()
        targets[: len(targets) - fresh] = IGNORE  # scored by an earlier window
        return Batch(window[None, :-1], targets[None])

    def targets(self, indices: np.ndarray) -> int:
        return sum(self.spans[int(i)][2] for i in indices)


def evaluate_stride(model, tokens: np.ndarray, context: int, stride: int, chunk: int) -> dict:
    lm, windows = scoring_model(model, chunk), Windows(tokens, context, stride)
    progress = EvalProgress(max(len(tokens) - 1, 0), len(windows))
    result = Validator(_one_process(lm), 1, on_batch=progress.update).validate(lm, windows, TokenScores())
    progress.close()
    return result | {"held_out_tokens": max(len(tokens) - 1, 0)}


def _one_process(model: torch.nn.Module) -> Dist:
    """`shardlm eval` runs in one process, on the device its model is on."""
    return Dist(LaunchInfo("single"), next(model.parameters()).device)


@dataclass
class GenOptions:
    """`eval --generation N`: N held-out prompts, sampled with this temperature / top-p and seed; MAUVE's
    features from `featurizer` (a run dir, checkpoint or HF folder), or None for the evaluated model."""
    n: int = 0
    featurizer: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        from shardlm.inference.generate import check_options

        if self.n < 0:
            raise ShardlmError(f"--generation must be >= 0 (0 = off), got {self.n}.")
        check_options(1, self.temperature, 0, self.top_p, 1, 1)
        if self.n:
            for module in MODULES:
                require(module)


def evaluate_path(path: str, overrides: list[str], stride: int | None = None, gen: GenOptions | None = None,
                  exact_match: int = 0) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = gen or GenOptions()
    gen.check()  # before any model is loaded
    stdout = sys.stdout  # online RL's JSON line, written from inside the redirect
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON line alone (scripts parse it)
        model, tokenizer, saved, ckpt = load_for_inference(path, device.type)
        context = context_length(model.config) or 1024
        if stride is not None and not 1 <= stride <= context:
            raise ShardlmError(f"--stride {stride}: give 1..{context} (the model's context); a larger stride "
                               "would skip the tokens between windows.")
        flat = to_flat_dict(inference_config(saved))
        flat["train.eval_batches"] = 0  # the whole validation set unless told otherwise
        flat.update(parse_overrides(overrides))
        cfg = build_config({k: v for k, v in flat.items() if not k.startswith(("model.", "lora."))})
        if objectives.spec(cfg).reads == "prompts" and not (stride or gen.n or exact_match):  # as its validation
            result = evaluate_prompts(model, tokenizer, cfg, device)
            family = objective_family(cfg.train.objective)
            print(f"val {family.describe_val(cfg, result, result['held_out_tokens'])}", file=sys.stderr)
            print(json.dumps(result), file=stdout)
            return result
        tails = _validation_tails(cfg, tokenizer, device, exported=saved is None)
        pairs = [t for t in tails if isinstance(t, ExampleRows) and t.group == 2]
        if pairs:
            if stride or gen.n or exact_match or len(pairs) < len(tails):
                raise ShardlmError("the validation data holds preference pairs: shardlm eval scores them as the "
                                   "run's validation does (loss, rewards/*); --stride, --generation and "
                                   "--exact-match score text or answers, so point data.val at text or examples "
                                   "for those.")
            result = evaluate_pairs(model, tokenizer, saved, cfg, pairs[0], device, str(path))
        text = [t for t in tails if not isinstance(t, ExampleRows)]
        if len(text) < len(tails) and stride:
            raise ShardlmError("--stride scores continuations of text; the validation data holds examples. Score "
                               "their answers with --exact-match N (or --generation N).")
        tokens = np.concatenate(text) if text else np.zeros(0, dtype=np.int64)
    if pairs:
        return _report(result, cfg, ckpt)
    seq_len = min(cfg.data.seq_len, context)
    examples = len(text) < len(tails)
    if gen.n and not examples:
        held_out_prompts(tokens, seq_len, gen.n, seq_len // 2)  # enough held-out blocks? Before the long part
    result = _evaluate(model, tokens, tails, cfg, context, stride or 0, device)
    _report(result, cfg, ckpt, last=False)
    if gen.n:
        result["generation"] = _answer_quality(model, tokenizer, cfg, gen) if examples else \
            evaluate_generation(model, tokenizer, tokens, seq_len, gen, device)
        log_generation(ckpt, result["generation"])
    if exact_match:
        result.update(_exact_match(model, tokenizer, cfg, exact_match))
        print(f"exact match {result['exact_match']:.3f} on {result['exact_match_n']} held-out prompts", file=sys.stderr)
    print(json.dumps(result))
    return result


def _report(result: dict, cfg: Config, ckpt: Path | None, last: bool = True) -> dict:
    """The validation line of training (observe.metrics.describe_val) on stderr, with what was scored where that
    is not what the run validated; `last`: the JSON line on stdout too."""
    if (scored := scored_model(ckpt)) is not None:
        result["scored"] = scored
        print(f"note: {scored}", file=sys.stderr)
    print(describe_val(result, result["held_out_tokens"], cfg.train.eval_batches), file=sys.stderr)
    if last:
        print(json.dumps(result))
    return result


def scored_model(ckpt: Path | None) -> str | None:
    """What eval scores when it is not the model the run validated: a QLoRA run validated its adapters on the
    4-bit base, and eval (like export) merges them into the full-precision base, so the losses differ a little."""
    if ckpt is None or not lora.quantized(read_config(ckpt).lora):
        return None
    return ("this QLoRA run validated on its 4-bit (nf4) base; eval scores its adapters merged into the "
            "full-precision base, the model `shardlm export` writes, so the loss differs a little from the run's")


def evaluate_pairs(model, tokenizer, saved: Config | None, cfg: Config, rows: ExampleRows, device: torch.device,
                   path: str) -> dict:
    """Preference pairs scored as the run's validation scores them: its objective and preference settings, against
    the run's reference (dpo, ipo). That is the model the run started from (its model.name, or a scratch model's
    seed): built first, its log-probabilities of the pairs read from beside the example cache (or scored now and
    stored there; a live reference's run stored nothing: scored now, in memory). An exported folder has no run:
    only the reference-free objectives (simpo, orpo), named with train.objective."""
    from shardlm.objectives.preference.pairs import PairScores, Preference
    from shardlm.training.build import init_dist

    objective, spec = cfg.train.objective, objectives.spec(cfg)
    if spec.reads != "pairs":
        raise ShardlmError("the validation data holds preference pairs, which the next-token loss does not score: "
                           "evaluate a preference run, or name its objective (train.objective=dpo, ipo, simpo or "
                           "orpo).")
    if saved is None and spec.reference:
        raise ShardlmError(f"train.objective={objective} scores pairs against the reference, the model a run "
                           f"started from: an exported folder does not record it. Evaluate the run's checkpoint "
                           f"(or its run dir) instead, or use a reference-free objective (simpo, orpo).")
    parallel = dataclasses.replace(cfg.parallel, fsdp=False, cpu_offload=False, compile="false",
                                   device=device.type, launcher="single")
    # a LoRA run's weights are merged; its reference is the base with the adapters at zero, i.e. the base
    model_cfg = saved.model if saved is not None else dataclasses.replace(Config().model, name=path)
    run_cfg = dataclasses.replace(cfg, model=model_cfg, lora=LoraConfig(), parallel=parallel)
    dist, plan = init_dist(run_cfg)
    # without FSDP's mixed-precision policy, the run's compute dtype is autocast's (as the Trainer does)
    autocast: Any = contextlib.nullcontext if plan.dtype == torch.float32 else \
        (lambda: torch.autocast(device.type, dtype=plan.dtype))
    validator = Validator(dist, cfg.train.batch_size, cfg.train.eval_batches, autocast)
    preference = Preference(run_cfg, device)
    if preference.needs_reference:
        preference.reference = _reference(run_cfg, tokenizer, plan, dist, rows, validator)
    chunk = auto_loss_chunk(cfg.train.loss_chunk_size, cfg.train.batch_size, rows.seq_len, model.config.vocab_size,
                            device)
    result = validator.validate(scoring_model(model, chunk), rows, PairScores(preference))
    return result | {"held_out_tokens": rows.target_tokens}


def _reference(run_cfg: Config, tokenizer, plan, dist: Dist, rows: ExampleRows, validator: Validator) -> dict:
    """The reference's log-probabilities of the pairs: the run's initial model, built as the run built it, scores
    them (or its stored values are read)."""
    from shardlm.objectives.preference.reference import ReferenceSource, prepare_reference
    from shardlm.training.build import build_model

    hf_config = model_config(run_cfg, tokenizer)
    torch.manual_seed(run_cfg.train.seed)
    initial = build_model(run_cfg, hf_config, plan, dist)
    source = ReferenceSource(run_cfg, hf_config, plan, dist, initial, {"val": rows}, 0, validator.batch,
                             validator.autocast)
    return prepare_reference(source, store=run_cfg.preference.reference != "live")


def evaluate_generation(model, tokenizer, tokens: np.ndarray, seq_len: int, gen: GenOptions,
                        device: torch.device) -> dict:
    """shardlm.inference.genquality's metrics of `gen.n` held-out prompts, printed to stderr as a few lines."""
    featurizer = None
    if gen.featurizer:
        with contextlib.redirect_stdout(sys.stderr):
            f_model, f_tok, _cfg, _ckpt = load_for_inference(gen.featurizer, device.type)
        featurizer = (f_model, f_tok)
    began = time.perf_counter()
    out = generation_quality(model, tokenizer, tokens, seq_len, gen.n, gen.temperature, gen.top_p, gen.seed,
                             featurizer)
    out |= {"prompts": gen.n, "prompt_tokens": seq_len // 2, "new_tokens": seq_len - seq_len // 2,
            "temperature": gen.temperature, "top_p": gen.top_p, "seed": gen.seed,
            "mauve_features": gen.featurizer or "the evaluated model (last hidden state)",
            "seconds": round(time.perf_counter() - began, 2)}
    print(describe_generation(out), file=sys.stderr)
    return out


def describe_generation(g: dict) -> str:
    ref = g["reference"]
    few = f"; noisy below ~{FEW_FOR_MAUVE} samples" if g["prompts"] < FEW_FOR_MAUVE else ""
    return "\n".join([
        f"generation: {g['prompts']} held-out prompts of {g['prompt_tokens']} tokens, {g['new_tokens']} new tokens "
        f"sampled (temperature {g['temperature']:g}, top-p {g['top_p']:g}, seed {g['seed']}) in {g['seconds']:.1f}s",
        "                 samples  true continuations",
        *(f"  {name:<14} {g[key]:7.3f}  {ref[key]:7.3f}" for name, key in
          (("distinct-1", "distinct_1"), ("distinct-2", "distinct_2"), ("distinct-3", "distinct_3"),
           ("rep-4", "rep_4"), ("self-BLEU", "self_bleu"), ("mean words", "mean_words"))),
        f"  ROUGE-L vs the true continuations {g['rouge_l']:.3f}; mean length {g['mean_tokens']:.1f} tokens",
        f"  MAUVE {g['mauve']:.3f} (features: {g['mauve_features']}{few})"])


def log_generation(ckpt: Path | None, g: dict) -> None:
    """Appends the numbers to the run's metrics.jsonl (split "gen", the checkpoint's step), so `shardlm plot`
    draws them; an exported folder has no run to append to."""
    if ckpt is None:
        return
    run = run_dir_of(ckpt)
    if run is None or not metrics_file(run).is_file():
        return
    step = read_manifest(ckpt).get("step")
    record = {"step": step, "split": "gen", "source": "eval",
              **record_fields(g)}
    with open(metrics_file(run), "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended to {metrics_file(run)} (split gen, step {step})", file=sys.stderr)


def _evaluate(model, tokens: np.ndarray, tails: list[np.ndarray], cfg, context: int, stride: int,
              device: torch.device) -> dict:
    """`tokens`: the tails one after another (a stride reads them as one stream). Block mode scores the blocks
    training validated on: a mixture's held-out tails interleaved, as there."""
    vocab, t = model.config.vocab_size, cfg.train
    if stride:  # one window of `context` tokens at a time
        chunk = auto_loss_chunk(t.loss_chunk_size, 1, context, vocab, device)
        return evaluate_stride(model, tokens, context, stride, chunk)
    parts = [tail if isinstance(tail, ExampleRows) else TokenBlocks(tail, min(cfg.data.seq_len, context))
             for tail in tails]
    blocks = parts[0] if len(parts) == 1 else MixtureBlocks.interleaved([p for p in parts if len(p)])
    chunk = auto_loss_chunk(t.loss_chunk_size, t.batch_size, blocks.seq_len, vocab, device)
    return evaluate_blocks(model, blocks, t.batch_size, t.eval_batches, chunk)


def _held_out_examples(cfg, n: int) -> list:
    """The first N held-out examples: data.val's, or each source's held-out tail."""
    from shardlm.inference import exact_match

    specs = [cfg.data.val] if cfg.data.val else \
        (cfg.data.train if isinstance(cfg.data.train, list) else [cfg.data.train])
    tail = None if cfg.data.val else cfg.data.val_fraction
    return [e for spec in specs for e in exact_match.held_out_examples(spec, "validation", cfg.data, tail, n)][:n]


def _exact_match(model, tokenizer, cfg, n: int) -> dict:
    """`--exact-match N`: greedy answers to the first N held-out prompts."""
    from shardlm.inference import exact_match

    return exact_match.summary(exact_match.score(model.eval(), tokenizer, _held_out_examples(cfg, n)))


def _answer_quality(model, tokenizer, cfg, gen: GenOptions) -> dict:
    """`--generation N` on examples: sampled answers to N held-out prompts against their references."""
    from shardlm.inference import exact_match

    scored = exact_match.score(model.eval(), tokenizer, _held_out_examples(cfg, gen.n), temperature=gen.temperature,
                               top_p=gen.top_p, seed=gen.seed)
    out = exact_match.answer_quality(scored, gen.temperature, gen.top_p, gen.seed)
    print(exact_match.describe_answers(out), file=sys.stderr)
    return out


def _validation_tails(cfg, tokenizer, device: torch.device, exported: bool) -> list:
    from shardlm.data import load_split

    spec = cfg.data.val or (None if exported else cfg.data.train)
    if spec is None:
        raise ShardlmError("an exported model carries no data settings: pass data.val=PATH (or hf:...).")
    dist = Dist(LaunchInfo("single"), device)
    def held_out(data, spec: str, tail: bool):
        start = int(len(data) * (1 - cfg.data.val_fraction)) if tail else 0
        if isinstance(data, ExampleSet):  # rows of examples, as training validated on them
            d = cfg.data
            return ExampleRows(data, d.seq_len, start, None, d.packing, d.truncation, spec)
        return data[start:]

    if cfg.data.val is not None:
        return [held_out(load_split(spec, cfg.data, tokenizer, dist, "validation"), spec, False)]
    # the held-out tail of the training data, as during training: of each sampled source of a mixture
    specs = spec if isinstance(spec, list) else [spec]
    weights = cfg.data.weights or [1.0] * len(specs)
    return [held_out(load_split(s, cfg.data, tokenizer, dist, "validation"), s, True)
            for s, w in zip(specs, weights, strict=True) if w > 0]
