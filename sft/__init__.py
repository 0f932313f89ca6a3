"""SFT: the supervised stage that trains the LoRA adapter ESSA and F-GRPO start from
(completion-only cross-entropy on the task's worked solutions, data parallel over ranks)."""
