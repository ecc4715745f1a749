"""From records to results: the per-run frame and per-cell summary, tables, plots, W&B dashboards."""
