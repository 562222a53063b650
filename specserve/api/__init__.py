"""OpenAI-compatible HTTP API: schemas, conversions, metrics and the FastAPI app (no Ray here)."""
