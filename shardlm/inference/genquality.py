"""Generation quality: how varied, repetitive and human-like sampled continuations are, as plain functions
(`shardlm eval --generation N` calls them; a training callback can too).

Text metrics work on whitespace-separated words, so they compare models with different tokenizers:
- distinct-n (Li et al., 2016): unique n-grams / all n-grams over every sample together (1 = no n-gram
  repeats anywhere; low = the model says the same things);
- repetition rate, rep-n (Welleck et al., 2020): per sample, the share of its n-grams that repeat an
  earlier one in the same sample, averaged (0 = no loops);
- self-BLEU (Zhu et al., 2018): mean BLEU of each sample against all the others (sacrebleu; 1 = identical
  samples, low = diverse);
- ROUGE-L: mean F-measure of the longest common subsequence with the true continuation (rouge-score);
- MAUVE (Pillutla et al., 2021, `mauve-text`): how close the distribution of generated texts is to that
  of the true ones, from feature vectors of both (1 = indistinguishable). It needs a few hundred samples
  or more to be stable; with fewer it is reported but noisy.

The libraries are the `gen` extra (pip install shardlm[gen]); a missing one is a one-line error.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardlm import ShardlmError
from shardlm.callbacks import Callback, StepResult, TrainerView

MODULES = {"rouge_score": "rouge-score", "sacrebleu": "sacrebleu", "mauve": "mauve-text"}
FEW_FOR_MAUVE = 100  # below this many samples MAUVE's clusters are too few to trust


def require(module: str) -> Any:
    """The metric library `module`, or a one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ShardlmError(f"generation metrics need the {MODULES[module]} package, which is not installed: "
                           "pip install shardlm[gen].") from None


def words(text: str) -> list[str]:
    return text.split()


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Unique n-grams / all n-grams, counted over all texts together; 0.0 when they hold no n-gram."""
    grams = [g for text in texts for g in ngrams(words(text), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(texts: Sequence[str], n: int = 4) -> float:
    """Mean over texts (those with at least one n-gram) of the share of n-grams already seen in that text."""
    rates = []
    for text in texts:
        grams = ngrams(words(text), n)
        if grams:
            rates.append(1 - len(set(grams)) / len(grams))
    return float(np.mean(rates)) if rates else 0.0


def self_bleu(texts: Sequence[str]) -> float:
    """Mean sentence BLEU (0..1, sacrebleu's defaults) of each text against all the others as references.
    Quadratic in the number of texts (~4 s for 200 on one CPU core): fine for eval's hundreds of samples."""
    sacrebleu = require("sacrebleu")
    if len(texts) < 2:
        return 0.0
    scores = [sacrebleu.sentence_bleu(t, [o for j, o in enumerate(texts) if j != i]).score
              for i, t in enumerate(texts)]
    return float(np.mean(scores)) / 100


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F-measure of each prediction against its reference (rouge-score, no stemming)."""
    scorer = require("rouge_score.rouge_scorer").RougeScorer(["rougeL"], use_stemmer=False)
    scores = [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references, strict=True)]
    return float(np.mean(scores)) if scores else 0.0


def mauve_score(p_features: np.ndarray, q_features: np.ndarray, seed: int = 25) -> float:
    """MAUVE between feature sets P (true texts) and Q (generated), rows = texts; seeded, CPU (faiss)."""
    mauve = require("mauve")
    out = mauve.compute_mauve(p_features=np.asarray(p_features, dtype=np.float32),
                              q_features=np.asarray(q_features, dtype=np.float32), device_id=-1, verbose=False,
                              seed=seed)
    return float(out.mauve)


def text_metrics(samples: Sequence[str], references: Sequence[str] | None = None) -> dict[str, float]:
    """distinct-1/2/3, rep-4, self-BLEU and mean length in words; ROUGE-L too when references are given."""
    out = {f"distinct_{n}": distinct_n(samples, n) for n in (1, 2, 3)}
    out |= {"rep_4": repetition_rate(samples, 4), "self_bleu": self_bleu(samples),
            "mean_words": float(np.mean([len(words(s)) for s in samples])) if samples else 0.0}
    if references is not None:
        out["rouge_l"] = rouge_l(samples, references)
    return out


# ---- held-out prompts, sampled continuations and their features ------------------------------------------
def check_generation(t: Any, val: Any) -> None:
    """`train.gen_every`'s libraries and held-out blocks, checked before training by the run (on every rank) and by
    `--dry-run` alike, so a missing one fails before the first step rather than on rank 0 alone at step N."""
    if not t.gen_every:
        return
    from shardlm.data import TokenBlocks

    for module in MODULES:
        require(module)
    if hasattr(val, "parts"):  # the callback samples from one token stream
        raise ShardlmError(f"train.gen_every scores continuations of one source's held-out text; the validation "
                           f"data is a mixture of {len(val.parts)} sources. Set data.val to one text source, or "
                           "train.gen_every=0.")
    if not isinstance(val, TokenBlocks):
        raise ShardlmError("train.gen_every scores continuations of held-out text; the validation data holds "
                           "examples. Score their answers with `shardlm eval RUN --exact-match` instead.")
    held_out_prompts(val.tokens[val.start:val.end], val.seq_len, t.gen_samples, val.seq_len // 2,
                     option="train.gen_samples")


def held_out_prompts(tokens: np.ndarray, seq_len: int, n: int, prompt_len: int,
                     option: str = "--generation") -> tuple[list, list]:
    """(prompt ids, true continuation ids) of `n` blocks of `seq_len` tokens spread evenly over `tokens`:
    each block's first `prompt_len` tokens and the rest. Deterministic, so a run gives the same prompts.
    `option` is what set `n`, named in the error."""
    blocks = (len(tokens) - 1) // seq_len
    if blocks < n:
        raise ShardlmError(f"{option} {n} needs {n} held-out blocks of {seq_len} tokens, but the validation "
                           f"data holds {max(blocks, 0)}: lower {option} or data.seq_len, or give more data "
                           "(data.val=FILE).")
    starts = np.linspace(0, blocks - 1, n).round().astype(np.int64) * seq_len
    rows = [np.asarray(tokens[s:s + seq_len]).tolist() for s in starts]
    return [r[:prompt_len] for r in rows], [r[prompt_len:] for r in rows]


def last_hidden_features(model, sequences: list[list[int]], batch_size: int = 16) -> np.ndarray:
    """One vector per sequence: the model's last-layer hidden state at its last token (MAUVE's featurization,
    with this model instead of GPT-2 large). Right-padded batches: a causal model's state at a real token
    never sees the padding after it. Sequences longer than the model's context keep their end."""
    import torch

    from shardlm.models.hf_config import context_length

    context = context_length(model.config) or max(map(len, sequences))
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for first in range(0, len(sequences), batch_size):
            batch = [s[-context:] or [0] for s in sequences[first:first + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([s + [0] * (width - len(s)) for s in batch], device=device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch], device=device)
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            last = torch.tensor([len(s) - 1 for s in batch], device=device)
            out.append(hidden[torch.arange(len(batch), device=device), last].float().cpu().numpy())
    return np.concatenate(out)


def record_fields(g: dict[str, Any]) -> dict[str, int | float]:
    """The numbers of a `generation_quality` result that go into a metrics record (split "gen")."""
    return {k: v for k, v in g.items() if isinstance(v, (int, float)) and k != "seconds"}


def sample_continuations(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                         top_p: float = 1.0, seed: int = 0, batch_size: int = 16) -> list[list[int]]:
    """One sampled continuation per prompt (new token ids, a final EOS dropped), seeded once."""
    import torch

    from shardlm.inference.generate import generate_batch, pad_id

    torch.manual_seed(seed)
    eos, out = tokenizer.eos_token_id, []
    for first in range(0, len(prompts), batch_size):
        rows = generate_batch(model, prompts[first:first + batch_size], max_new_tokens, eos, temperature,
                              top_p=top_p, pad=pad_id(tokenizer))
        out += [new[:-1] if new and new[-1] == eos else new for [new] in rows]
    return out


def generation_quality(model, tokenizer, tokens: np.ndarray, seq_len: int, n: int, temperature: float = 1.0,
                       top_p: float = 1.0, seed: int = 0, featurizer: tuple | None = None) -> dict[str, Any]:
    """The metrics of `n` continuations sampled from held-out prompts (each block's first half; as many new
    tokens as the true continuation has), with those of the true continuations under "reference" for scale.
    MAUVE's features come from `featurizer` = (model, tokenizer), by default `model` itself."""
    prompts, truths = held_out_prompts(tokens, seq_len, n, seq_len // 2)
    news = sample_continuations(model, tokenizer, prompts, seq_len - seq_len // 2, temperature, top_p, seed)
    samples = [_continuation(tokenizer, p, c) for p, c in zip(prompts, news, strict=True)]
    references = [_continuation(tokenizer, p, t) for p, t in zip(prompts, truths, strict=True)]
    out: dict[str, Any] = text_metrics(samples, references)
    out["mean_tokens"] = float(np.mean([len(c) for c in news]))
    if featurizer is None:  # the token ids themselves, as the model saw them
        p_seqs = [p + t for p, t in zip(prompts, truths, strict=True)]
        q_seqs = [p + c for p, c in zip(prompts, news, strict=True)]
        f_model = model
    else:  # the texts, in the featurizer's own tokens
        f_model, f_tok = featurizer
        heads = [tokenizer.decode(p) for p in prompts]
        p_seqs = [f_tok(h + r)["input_ids"] for h, r in zip(heads, references, strict=True)]
        q_seqs = [f_tok(h + s)["input_ids"] for h, s in zip(heads, samples, strict=True)]
    out["mauve"] = mauve_score(last_hidden_features(f_model, p_seqs), last_hidden_features(f_model, q_seqs))
    out["reference"] = text_metrics(references)
    return out


def _continuation(tokenizer, prompt: list[int], new: list[int]) -> str:
    from shardlm.inference.generate import decode_sample

    return decode_sample(tokenizer, prompt, new)[1]


class GenerationQuality(Callback):
    """`train.gen_every=N`: every N steps, the numbers of `shardlm eval --generation` for `train.gen_samples`
    held-out prompts (the first half of validation blocks), as a `"split": "gen"` record: metrics.jsonl,
    TensorBoard, W&B/MLflow, and `shardlm plot` draws them. Every rank takes part in gathering the weights
    to rank 0 (a collective); rank 0 samples and scores, seeded with train.seed."""

    def __init__(self, every: int, samples: int):
        self.every, self.samples = every, samples

    def on_step_end(self, trainer: TrainerView, result: StepResult) -> None:  # noqa: ARG002 - the interface
        if trainer.step % self.every == 0:
            self.measure(trainer)

    def measure(self, trainer: TrainerView) -> None:
        from shardlm.distributed.full_state import gather_hf_model

        run = trainer.run
        hf = gather_hf_model(run.model, run.hf_config, run.dist, run.dist.generation_device)
        if hf is not None:
            val = run.val
            g = generation_quality(hf.eval(), run.tokenizer, val.tokens[val.start:val.end], val.seq_len,
                                   self.samples, seed=run.cfg.train.seed)
            trainer.report.log.write({"step": trainer.step, "split": "gen", "source": "train", **record_fields(g)})
        run.dist.barrier()
