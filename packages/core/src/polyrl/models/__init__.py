"""Model and tokenizer helpers: tiny models built in code for tests and the quickstart."""
