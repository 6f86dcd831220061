"""`llmopt run`: a recipe's stages (quantize -> eval -> bench -> serve) as one resumable run.

stages.py plans each stage from a validated recipe (the library call, the equivalent command
line, what decides its result); runner.py runs them in order, reusing stamped results in the run
folder and writing results.json; report.py writes report.md and commands.sh.
"""
