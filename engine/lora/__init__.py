"""Multi-LoRA: PEFT adapters served side by side in one batch (see manager.py)."""
