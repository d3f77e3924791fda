"""simcloud: a local ECS endpoint and Kubernetes API server for the demo and the tests."""
