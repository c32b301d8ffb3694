"""speculative package."""
