"""The eval tasks' scoring: perplexity windows, KL divergence, log-likelihood, MMLU, HumanEval, lm-eval."""
