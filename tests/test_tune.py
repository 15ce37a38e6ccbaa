"""`shardlm tune`: batch search under a budget, a table, and a YAML file `shardlm train` accepts."""

import yaml

from conftest import shardlm_cli, tiny
from shardlm.config import load_config


def test_tune_finds_batches_and_writes_a_usable_override(corpus, cache_dir, tmp_path):
    args = tiny(corpus, cache_dir, tmp_path / "run", **{"model.tokenizer": "gpt2", "data.seq_len": 32})
    out = tmp_path / "tuned.yaml"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("precious")
    proc = shardlm_cli(["tune", *args, "--budget-gb", "0.1", "--steps", "1", "--max-batch", "16",
                        "--out", str(out)], timeout=600, cwd=tmp_path)
    # trials write into a scratch folder: neither the run's out_dir nor ./runs/default is touched
    assert (tmp_path / "run" / "config.yaml").read_text() == "precious"
    assert not (tmp_path / "runs").exists()
    table = proc.stdout
    assert "max batch" in table and "best:" in table
    rows = [line.split() for line in table.splitlines() if line.startswith("full ")]
    batches = {(r[1], r[2]): int(r[5]) for r in rows}  # (AC, loss chunk) -> max batch
    assert batches[("False", "1024")] >= 2 * batches[("False", "0")]  # chunked loss fits far more
    best = yaml.safe_load(out.read_text())
    assert 1 <= best["train"]["batch_size"] <= 16
    cfg = load_config([], [f"{s}.{k}={v}" for s, sec in best.items() for k, v in sec.items()])
    assert cfg.train.batch_size == best["train"]["batch_size"]
