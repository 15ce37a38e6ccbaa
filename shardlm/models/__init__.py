"""The model: an HF causal LM behind shardlm's loss, its LoRA adapters, fp8 linears, state-dict keys."""
