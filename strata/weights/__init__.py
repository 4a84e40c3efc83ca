"""Opening checkpoints: HF folders and GGUF files into a stage's layers."""
