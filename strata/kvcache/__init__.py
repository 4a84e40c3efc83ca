"""KV kept across requests: the prefix cache's index and stores, KV files."""
