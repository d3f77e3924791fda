# The project's Airflow image: the official image plus the pinned project requirements,
# with the plugin library and the DAGs baked in (docker-compose.yaml mounts live copies
# over them for development).
#
# The tag must equal the apache-airflow pin in requirements.txt; pip re-pins apache-airflow
# to the image's own version so a mismatch fails the build instead of silently upgrading
# Airflow inside the image (tests/static/test_compose.py checks both).
FROM apache/airflow:3.3.2

USER root
# Shared workdir of the local cloud (kubeconfig, ecs.json, connections.json). A named volume
# mounted here inherits this ownership; group 0 keeps it writable for any AIRFLOW_UID.
RUN mkdir -p /opt/simcloud && chown 50000:0 /opt/simcloud && chmod 2775 /opt/simcloud
USER airflow

COPY --chown=airflow:0 requirements.txt /requirements.txt
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" -r /requirements.txt

COPY --chown=airflow:0 plugins/ /opt/airflow/plugins/
COPY --chown=airflow:0 dags/ /opt/airflow/dags/
