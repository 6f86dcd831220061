"""Running untrusted, model-written Python in OS sandboxes and judging it from outside (`runner.py`)."""
