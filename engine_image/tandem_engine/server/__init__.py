"""The engine process (`tandem-engine`): the worker loop on ZMQ, the KV handoff
between engines, the lifecycle control and the admin HTTP API."""
