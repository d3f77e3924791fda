"""Airflow DAG for the job spec next to this file (same name, .yaml): see gpuboot.task_groups.spec_dags."""

from gpuboot.task_groups.spec_dags import dag_from_spec_file

dag = dag_from_spec_file(__file__)
