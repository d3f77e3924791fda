"""gpuboot: boot stopped ECS GPU instances for Kubernetes jobs, as Airflow tasks."""
