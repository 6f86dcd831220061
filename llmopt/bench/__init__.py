"""`llmopt bench`: offline engine comparison, an online load generator, latency with a roofline, reports."""
