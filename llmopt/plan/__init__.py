"""`llmopt plan`: weights, K/V, GPUs and the decode roofline of a model, from its architecture alone."""
