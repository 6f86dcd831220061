"""`llmopt eval`: perplexity, KL divergence, MMLU and HumanEval, with quality gates."""
