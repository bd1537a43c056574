"""Training: model definitions (datasets, loop and launcher live beside them)."""
