"""The pure core: values, decisions and ports. No I/O library, no Airflow."""
