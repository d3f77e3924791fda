"""Benchmark baseline: a plain KubernetesPodOperator pinned to an already running GPU node.

Loaded only by `python -m bench` (which points Airflow's DAG folder at a scratch folder
holding this file and dags/gpu_job.py), never from the project's dags/.
"""
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import DAG
from kubernetes.client import models as k8s

NODE = "t4-running"
COMMAND = ["python", "-c", "print('bench pod ran', flush=True)"]

with DAG(dag_id="bench_plain_kpo", schedule=None, catchup=False, tags=["bench"]) as dag:
    KubernetesPodOperator(
        task_id="plain", name="bench-plain", namespace="default", image="python:3.11-slim", cmds=COMMAND,
        node_selector={"kubernetes.io/hostname": NODE}, get_logs=True, in_cluster=False,
        kubernetes_conn_id="kubernetes_default", on_finish_action="keep_pod", random_name_suffix=True,
        container_resources=k8s.V1ResourceRequirements(
            requests={"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}, limits={"nvidia.com/gpu": "1"}))
