# The project's Airflow image: the official image plus the pinned project requirements,
# with the plugin library, the DAGs and the local cloud (simcloud, run by the compose demo's
# `simcloud` service) baked in. docker-compose.yaml mounts live copies of dags/ and plugins/
# over them for development; the simcloud service runs the copy in the image.
#
# The tag must equal the apache-airflow pin in requirements.txt; pip re-pins apache-airflow
# to the image's own version so a mismatch fails the build instead of silently upgrading
# Airflow inside the image. The Python of the tag is the one constraints.txt was resolved for
# (`uv pip compile -p 3.11`, see its header), so the image gets the same versions of every
# package the test suite ran against (tests/static/test_compose.py checks all three).
FROM apache/airflow:3.3.2-python3.11

COPY --chown=airflow:0 requirements.txt /requirements.txt
COPY --chown=airflow:0 constraints.txt /constraints.txt
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" -r /requirements.txt -c /constraints.txt

COPY --chown=airflow:0 plugins/ /opt/airflow/plugins/
COPY --chown=airflow:0 dags/ /opt/airflow/dags/
COPY --chown=airflow:0 simcloud/ /opt/gpuboot/simcloud/
