# The project's Airflow image: the official image plus the gpuboot provider wheel (`make dist`
# builds it into dist/; run it before `docker compose build`), with the DAGs and the local cloud
# (simcloud, run by the compose demo's `simcloud` service) baked in. The wheel brings the plugin
# library, the ECS hook's connection type and the plugin (entry points); its `simcloud` extra
# the local cloud's dependencies. docker-compose.yaml mounts a live copy of dags/ over the baked
# one; the package comes only from the wheel (rebuild after changing plugins/).
#
# The tag must equal the apache-airflow pin in requirements.txt; pip re-pins apache-airflow
# to the image's own version so a mismatch fails the build instead of silently upgrading
# Airflow inside the image. The Python of the tag is the one constraints.txt was resolved for
# (`uv pip compile -p 3.11`, see its header), so the image gets the same versions of every
# package the test suite ran against; the wheel's name carries pyproject.toml's version
# (tests/static/test_compose.py checks all four).
FROM apache/airflow:3.3.2-python3.11

COPY --chown=airflow:0 constraints.txt /constraints.txt
COPY --chown=airflow:0 dist/gpuboot-0.1.0-py3-none-any.whl /wheels/gpuboot-0.1.0-py3-none-any.whl
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" "/wheels/gpuboot-0.1.0-py3-none-any.whl[simcloud]" -c /constraints.txt

COPY --chown=airflow:0 dags/ /opt/airflow/dags/
COPY --chown=airflow:0 simcloud/ /opt/gpuboot/simcloud/
COPY --chown=airflow:0 deploy/kubernetes/ /opt/gpuboot/deploy/kubernetes/
