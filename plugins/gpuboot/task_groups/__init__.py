"""The gpu_job task group and the DAGs built from YAML job specs."""
