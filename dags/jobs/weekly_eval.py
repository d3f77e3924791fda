"""Airflow DAG for the job spec next to this file (same name, .yaml): see gpuboot.specdags."""

from gpuboot.specdags import dag_from_spec_file

dag = dag_from_spec_file(__file__)
