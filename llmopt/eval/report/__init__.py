"""The eval report: the JSON document, the terminal table, the per-sample logs."""
