"""F-GRPO: GRPO with focal-weighted group advantages g = (1 - p)^gamma (arXiv 2602.06717)."""
