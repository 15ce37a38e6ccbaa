"""The model: an HF causal LM behind shardlm's loss (`causal_lm`), its HF config (`hf_config`) and instantiation
(`instantiate`), its LoRA adapters, fp8 linears, state-dict keys."""
