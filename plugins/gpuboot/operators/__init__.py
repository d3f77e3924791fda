"""The Airflow operators of a GPU job's steps (place, start, launch, release) and scale-down."""
