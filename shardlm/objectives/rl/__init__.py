"""Online reinforcement learning from rewards (GRPO, Dr. GRPO, DAPO, RLOO): rewards, advantages and the loss,
and the sampling step, each usable on its own; the training loop drives them."""
