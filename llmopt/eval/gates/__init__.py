"""Quality gates: bounds on a candidate model's metrics vs its baseline, judged with bootstrap CIs."""
