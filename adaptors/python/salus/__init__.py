"""salus: share one GPU between many deep-learning jobs."""
