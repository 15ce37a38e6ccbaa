"""`shardlm sweep`: hyperparameter search with Optuna over any config keys (docs/sweep.md).

space: `--param KEY=KIND:ARGS` -> distributions; trial: the callback each trial's `shardlm train` runs (report,
prune) and the sweep folder's files; run: the study's loop, one `shardlm train` process per trial, the table;
plot: the study's figures. Optuna is imported only when a sweep runs (pip install 'shardlm[sweep]').
"""
