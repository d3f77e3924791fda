"""The Airflow plugin: the fleet and job pages, the run note, the triggerer warm-up."""
