"""Run under torchrun (or alone): for each `FOLDER` argument, 6 training steps of that pretrained folder into
`FOLDER-TAG` (checkpoints at steps 3 and 6); with `--resume`, a second trainer resumes step 3 and runs 3
steps. Prints one JSON line on rank 0: `{folder: {"losses", "resumed", "tied"}}`. Overrides follow `--`."""

import json
import sys

import torch

from shardlm.config import load_config
from shardlm.distributed.process_group import shutdown
from shardlm.training.build import build
from shardlm.training.trainer import Trainer

tag, resume = sys.argv[1], "--resume" in sys.argv
split = sys.argv.index("--")
folders, overrides = [a for a in sys.argv[2:split] if a != "--resume"], sys.argv[split + 1:]


def trainer_for(folder: str, *extra: str) -> Trainer:
    run = build(load_config(None, [*overrides, f"model.name={folder}", f"out_dir={folder}-{tag}", *extra]))
    return Trainer(run, checkpoint=True)


def steps(trainer: Trainer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        loss = trainer.dist.all_reduce_sum(trainer.train_step()["loss_sum"].double().reshape(1))
        out.append(loss.item() / (trainer.global_batch * trainer.seq_len))
    return out


result = {}
for folder in folders:
    trainer = trainer_for(folder, "checkpoint.resume=none")
    hf = trainer.model.hf
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    losses = steps(trainer, 3)
    trainer.checkpointer.save(trainer.step)
    losses += steps(trainer, 3)
    trainer.checkpointer.save(trainer.step)
    trainer.close()
    resumed = []
    if resume:
        again = trainer_for(folder, f"checkpoint.resume={folder}-{tag}/checkpoints/step_000000003")
        again.checkpointer.maybe_resume()
        resumed = steps(again, 3)
        again.close()
    result[folder] = {"losses": losses, "resumed": resumed, "tied": tied}
if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    print("RESULT " + json.dumps(result), flush=True)
shutdown(0)
