"""Tokenizing a corpus: `shardlm prepare` against the Hugging Face run_clm flow, same text, same run.

    python benchmarks/tokenization.py [--mb 32] [--scale 10] [--text PATH] [--out FILE]

The corpus is WikiText-2's train split (../shared/data/wikitext-2/train.txt, or --text) repeated to --mb
MB, as one .txt file. Both sides tokenize exactly those bytes with the GPT-2 tokenizer into a fresh cache,
each in its own process, timed from process start to exit:
- shardlm: `shardlm prepare data.train=corpus.txt model.tokenizer=gpt2` (one document, cut into
  token-neutral pieces, every core through the tokenizers library's thread pool);
- Hugging Face: run_clm.py's flow, `load_dataset("text", ...)` then
  `.map(lambda b: tokenizer(b["text"]), batched=True, num_proc=<cores>)`.
Peak RSS is sampled every 20 ms over the whole process tree (HF's map workers included). shardlm also runs
on the corpus repeated --scale times (RSS must stay flat), once with RAYON_NUM_THREADS=1 and once with
SHARDLM_TIKTOKEN=0 (the tokenizers library instead of tiktoken; both caches must be byte-identical), and
the GPT-2 tokenizer is timed on one whole 10.8 MB document (the naive way).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "train.txt"
GPT2 = ROOT / "shardlm" / "assets" / "gpt2-tokenizer"


def make_corpus(source: Path, mb: float, path: Path) -> int:
    text = source.read_bytes()
    times = max(1, int(-(-mb * 1e6 // len(text))))
    with open(path, "wb") as out:
        for _ in range(times):
            out.write(text)
    return path.stat().st_size


def tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Wall time and peak tree RSS of `cmd`; its last stdout line, if JSON, is merged in."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    result = {"seconds": round(seconds, 2), "peak_rss_mb": round(peak[0] / 2**20)}
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        result.update(json.loads(last))
    return result


def ours(corpus: Path, cache: Path, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "shardlm", "prepare", f"data.train={corpus}", "data.val=null",
           "model.tokenizer=gpt2", f"data.cache_dir={cache}"]
    result = measure(cmd, env)
    folder = next(p for p in cache.iterdir() if p.is_dir())
    meta = json.loads((folder / "meta.json").read_text())
    digest = hashlib.sha256()
    with open(folder / "tokens.bin", "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return {**result, "tokens": meta["num_tokens"], "tokens_sha256": digest.hexdigest()[:16],
            "mb_s_excluding_startup": round(meta["text_bytes"] / 1e6 / meta["seconds"], 2)}


def hf_worker(corpus: str, cache: str, cores: int) -> None:
    import pyarrow.compute as pc
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(GPT2))
    start = time.perf_counter()
    raw = load_dataset("text", data_files={"train": corpus}, cache_dir=cache, split="train")
    tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, num_proc=cores,
                        remove_columns=["text"])
    work = time.perf_counter() - start
    tokens = pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py()
    size = Path(corpus).stat().st_size
    print(json.dumps({"rows": len(tokenized), "tokens": tokens, "mb_s_excluding_startup": round(size / 1e6 / work, 2)}))


def whole_document(path: Path) -> None:
    """The naive way: one long document handed whole to the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(GPT2))
    text = path.read_text()
    tokens = len(tokenizer(text)["input_ids"])
    print(json.dumps({"mb": round(len(text.encode()) / 1e6, 2), "tokens": tokens}))


def extra_runs(corpus: Path, tmp_path: Path, one: dict, hf: dict, size: int, text: Path) -> dict:
    """The same corpus with one thread and without tiktoken (caches must match), and the naive way."""
    single = ours(corpus, tmp_path / "cache-1thread", {"RAYON_NUM_THREADS": "1"})
    print(f"shardlm 1x, 1 thread: {single}", file=sys.stderr)
    no_tiktoken = ours(corpus, tmp_path / "cache-hf-tokenizers", {"SHARDLM_TIKTOKEN": "0"})
    print(f"shardlm 1x, tokenizers library only: {no_tiktoken}", file=sys.stderr)
    naive = measure([sys.executable, __file__, "--whole-document", str(text)])
    mb_s = lambda r: round(size / 1e6 / r["seconds"], 2)  # noqa: E731
    return {
        "shardlm_prepare_1_thread": {**single, "mb_s": mb_s(single),
                                     "cache_identical": single["tokens_sha256"] == one["tokens_sha256"]},
        "shardlm_prepare_tokenizers_library_only": {
            **no_tiktoken, "mb_s": mb_s(no_tiktoken), "speedup_vs_hf": round(hf["seconds"] / no_tiktoken["seconds"], 2),
            "cache_identical": no_tiktoken["tokens_sha256"] == one["tokens_sha256"]},
        "whole_document_naive": naive,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=32.0, help="corpus size in MB (default 32)")
    p.add_argument("--scale", type=int, default=10, help="shardlm also runs on the corpus times this (RSS flat)")
    p.add_argument("--text", type=Path, default=WIKITEXT,
                   help="text repeated into the corpus (default: ../shared/data/wikitext-2/train.txt)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--hf-scale", action="store_true", help="also run the HF flow on the --scale x corpus")
    p.add_argument("--only-main", action="store_true", help="skip the 1-thread, tokenizers-only and naive runs")
    p.add_argument("--hf-worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--whole-document", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker[0], args.hf_worker[1], int(args.hf_worker[2]))
    if args.whole_document:
        return whole_document(args.whole_document)
    if not args.text.is_file():
        raise SystemExit(f"corpus '{args.text}' not found: pass --text PATH (any UTF-8 text, e.g. WikiText-2's "
                         "train.txt or shardlm/assets/tinyshakespeare/input.txt)")
    cores = os.cpu_count() or 1
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    os.environ.update(env)
    with tempfile.TemporaryDirectory(dir=os.environ.get("SHARDLM_BENCH_TMP")) as tmp:
        tmp_path = Path(tmp)
        corpus, big = tmp_path / "corpus.txt", tmp_path / "corpus_big.txt"
        size = make_corpus(args.text, args.mb, corpus)
        print(f"corpus: {size / 1e6:.1f} MB; {cores} cores", file=sys.stderr)
        hf = measure([sys.executable, __file__, "--hf-worker", str(corpus), str(tmp_path / "hf-cache"), str(cores)])
        print(f"hf: {hf}", file=sys.stderr)
        one = ours(corpus, tmp_path / "cache-1x")
        print(f"shardlm 1x: {one}", file=sys.stderr)
        extra = {}
        if not args.only_main:
            extra = extra_runs(corpus, tmp_path, one, hf, size, args.text)
        big_size = make_corpus(args.text, args.mb * args.scale, big)
        ten = ours(big, tmp_path / "cache-big")
        print(f"shardlm {args.scale}x: {ten}", file=sys.stderr)
        if args.hf_scale:
            hf_big = measure([sys.executable, __file__, "--hf-worker", str(big), str(tmp_path / "hf-big"), str(cores)])
            extra[f"hf_run_clm_{args.scale}x"] = {**hf_big, "mb_s": round(big_size / 1e6 / hf_big["seconds"], 2)}
            print(f"hf {args.scale}x: {hf_big}", file=sys.stderr)
    mb_s = lambda n, r: round(n / 1e6 / r["seconds"], 2)  # noqa: E731
    result = {
        "benchmark": "tokenize", "date": datetime.date.today().isoformat(),
        "machine": f"{cores}-core CPU ({platform.processor() or platform.machine()})",
        "corpus": f"WikiText-2 train.txt repeated to {size / 1e6:.1f} MB, one .txt file; GPT-2 tokenizer",
        "hf_run_clm": {**hf, "mb_s": mb_s(size, hf), "num_proc": cores},
        "shardlm_prepare": {**one, "mb_s": mb_s(size, one)},
        f"shardlm_prepare_{args.scale}x": {**ten, "mb": round(big_size / 1e6, 1), "mb_s": mb_s(big_size, ten)},
        **extra,
        "speedup": round(hf["seconds"] / one["seconds"], 2),
        "speedup_excluding_startup": round(one["mb_s_excluding_startup"] / hf["mb_s_excluding_startup"], 2),
        "note": "seconds from process start to exit (imports included); excluding startup = from reading the "
                "corpus to the cache written (shardlm) / load_dataset to the end of map (HF); peak RSS of the "
                "process tree",
    }
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
