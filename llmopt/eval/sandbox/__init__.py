"""Running untrusted, model-written Python in a separate, limited process (`runner.py`, `child.py`)."""
