"""The test cluster: a Kubernetes API server emulator, kubeconfig plumbing and helm for tests."""
