"""The engine's torch-free core: requests, the scheduler and the KV block manager.

The scheduler asks `kv/` every memory question and never touches a tensor; nothing
here imports torch (an import-linter contract holds that).
"""
