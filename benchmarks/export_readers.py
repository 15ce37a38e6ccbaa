"""The export contract, read by other readers than shardlm: transformers 5 (this environment) and transformers 4
(another install, given with --tf4), each loading the exported folder with the fast and the slow tokenizer and
decoding greedily with the folder's own generation defaults. Prints one JSON object.

    pip install --target /tmp/tf4 --no-deps "transformers==4.57.3" "huggingface_hub<1" "tokenizers<0.23"
    python benchmarks/export_readers.py --tf4 /tmp/tf4 [--out benchmarks/results/export_readers.json]

The folder is exported here from a short run of a byte-pair GPT-2 (the bundled GPT-2 tokenizer, 2 layers,
vocabulary padded to 64 as on a GPU: 50304 rows trained, 50257 exported). Checked for each reader: the
vocabulary size, that no id past the tokenizer's is reachable, the pad id in both config files, the slow and
fast tokenizers' ids on a sample text, and the greedy tokens against `shardlm generate --temperature 0`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT

READ = r"""
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt, text = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"transformers": transformers.__version__}
fast = AutoTokenizer.from_pretrained(folder)
try:
    slow = AutoTokenizer.from_pretrained(folder, use_fast=False)
    out["slow_tokenizer"] = type(slow).__name__
    out["slow_equals_fast"] = slow(text)["input_ids"] == fast(text)["input_ids"]
except Exception as e:  # noqa: BLE001 - recorded, not raised
    out["slow_tokenizer"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
model = AutoModelForCausalLM.from_pretrained(folder).eval()
ids = fast(prompt, return_tensors="pt")["input_ids"]
with torch.no_grad():
    new = model.generate(ids, max_new_tokens=24, pad_token_id=model.generation_config.pad_token_id)[0, ids.shape[1]:]
    logits = model(ids).logits
out.update(vocab_rows=int(logits.shape[-1]), tokenizer_len=len(fast), greedy=new.tolist(),
           generation_config={k: v for k, v in model.generation_config.to_diff_dict().items()
                              if k not in ("transformers_version",)},
           pad_ids=[model.config.pad_token_id, model.generation_config.pad_token_id])
print("RESULT " + json.dumps(out))
"""


def read(folder: Path, prompt: str, text: str, pythonpath: str | None) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, "-c", READ, str(folder), prompt, text], capture_output=True, text=True,
                          env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": proc.stderr[-1500:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tf4", default=None, help="a folder holding transformers 4 (pip install --target ...)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import shardlm

    prompt, text = "ROMEO: But soft,", "What light through yonder window breaks? It is the east."
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        hf = run / "hf"  # checkpoint.export_final
        shardlm.train(None, {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2, "model.tokenizer": "gpt2",
                             "model.vocab_multiple": 64, "data.train": "shakespeare", "data.seq_len": 64,
                             "train.batch_size": 8, "train.max_steps": 40, "train.eval_batches": 2,
                             "train.sample_tokens": 0, "log.tensorboard": False, "log.progress": "none",
                             "parallel.device": "cpu", "checkpoint.export_final": True}, out_dir=str(run))
        ours = shardlm.load(hf)
        ids = ours.tokenizer(prompt)["input_ids"]
        from shardlm.inference.generate import generate_tokens

        [want] = generate_tokens(ours.hf, ids, max_new_tokens=24, eos=ours.tokenizer.eos_token_id, temperature=0)
        files = sorted(x.name for x in hf.iterdir())
        readers = {"transformers 5": read(hf, prompt, text, None)}
        if a.tf4:
            readers["transformers 4"] = read(hf, prompt, text, a.tf4)
    for r in readers.values():
        if "greedy" in r:
            r["greedy_equals_shardlm_generate"] = r["greedy"] == want
    import torch

    result = {"benchmark": "export_readers", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "command": " ".join(["python", "benchmarks/export_readers.py", *sys.argv[1:]]), "files": files,
              "readers": readers, "ok": all(r.get("greedy_equals_shardlm_generate") and r.get("vocab_rows") == 50257
                                             and r.get("slow_equals_fast", False) for r in readers.values())}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
