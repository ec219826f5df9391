"""`llmserve bench`: load generation and reports."""
