"""Stage 2, lengths -> plan: boundary search, simulation, strategy and trade-off tables, the report."""
