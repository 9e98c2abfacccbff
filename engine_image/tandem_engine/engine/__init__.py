"""The engine: `LLMEngine` (the public, thread-safe surface of one model replica),
its outputs, and the offline `LLM` front."""
