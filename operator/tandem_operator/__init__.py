"""Tandem operator: reconciles InferencePools into prefill, decode and router pods (kopf).

Never imports torch: the operator image carries no engine dependencies.
"""
