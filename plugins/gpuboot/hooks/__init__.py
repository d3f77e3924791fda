"""Adapters: ECS and Kubernetes through their client libraries, behind Airflow hooks."""
