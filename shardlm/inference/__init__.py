"""Using a trained model: load, generate, generation quality, evaluate, export."""
