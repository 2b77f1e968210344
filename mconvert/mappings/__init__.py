"""Layout transforms (pure shard math) and one plugin table per model family."""
