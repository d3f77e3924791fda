"""The fleet page's assembly (gpuboot.ui.fleet_view): GPU counts, boot timelines, reservations, marks, a run's view."""
from __future__ import annotations

from gpuboot.core.inventory import build_inventory, parse_time
from gpuboot.core.model import Reservation, Unavailable
from gpuboot.core.placement import JobRequest, TaskRequest, place
from gpuboot.core.resources import Resources
from gpuboot.ui.fleet_view import boot_timeline, etag_of, fleet_view, observe_gpus, price_of, run_view
from tests.builders import TYPES, instance, node, pod

NOW = 1_800_000_000.0


def views(nodes, pods=(), instances=()):
    return build_inventory(list(nodes), list(pods), list(instances), TYPES, [], NOW)


def view_of(data, name):
    return next(n for n in data["nodes"] if n["name"] == name)


def test_gpus_split_into_used_by_pods_reserved_for_unbound_jobs_and_free():
    nodes = [node("a", gpus=2, heartbeat=NOW, labels={"gpuboot.io/price-per-hour": "4.2"}),
             node("b", gpus=2, heartbeat=NOW)]
    insts = [instance("a", start=NOW - 3600, gpus=2, itype="ecs.gn6i-c24g1.12xlarge"),
             instance("b", start=NOW - 3600, gpus=2, itype="ecs.gn6i-c24g1.12xlarge")]
    bound = pod("train-0", "b", requests={"nvidia.com/gpu": "1"},
                labels={"gpuboot.io/job": "gb-2", "gpuboot.io/task": "train"})
    reservations = [Reservation("gb-1", "train", "a", Resources({"nvidia.com/gpu": 2}), NOW + 600),
                    Reservation("gb-2", "train", "b", Resources({"nvidia.com/gpu": 1}), NOW + 600),
                    Reservation("gb-old", "train", "b", Resources({"nvidia.com/gpu": 1}), NOW - 1)]
    backed = {("b", "gb-2", "train")}
    vs = build_inventory(nodes, [bound], insts, TYPES, reservations, NOW)
    data = fleet_view(vs, nodes, reservations=reservations, backed=backed, marks=[], starts={}, instances={},
                      gpus_seen={}, now=NOW)
    assert view_of(data, "a")["gpus"] == {"total": 2, "used": 0, "reserved": 2, "free": 0}
    assert view_of(data, "b")["gpus"] == {"total": 2, "used": 1, "reserved": 0, "free": 1}
    assert view_of(data, "a")["price_per_hour"] == 4.2 == price_of(next(v for v in vs if v.name == "a"))
    # the live reservations, each saying whether its pod is bound yet
    assert [(r["job_id"], r["node"], r["gpus"], r["pod_bound"], r["expires_in_seconds"])
            for r in data["reservations"]] == [("gb-1", "a", 2, False, 600), ("gb-2", "b", 1, True, 600)]


def test_a_boot_in_progress_shows_each_moment_as_it_happens():
    start = NOW - 20
    stopped_before = node("g", gpus=2, ready="Unknown", transition=NOW - 7200, heartbeat=NOW - 7200)
    booting = [stopped_before]
    vs = views(booting, instances=[instance("g", "Starting", gpus=2)])
    data = fleet_view(vs, booting, reservations=[], backed=(), marks=[], starts={"g": ("gb-1", start)},
                      instances={}, gpus_seen={}, now=NOW)
    [boot] = data["boots"]
    assert (boot["node"], boot["job_id"], boot["state"], boot["done"]) == ("g", "gb-1", "booting", False)
    assert [(s["step"], s["at"]) for s in boot["timeline"]] == \
        [("start requested", start), ("Running", None), ("Ready", None), ("GPUs registered", None)]

    # Running (ECS StartTime, minute precision: never shown before the request), Ready after the start
    running = instance("g", "Running", start=start + 3, gpus=2)
    ready_node = node("g", gpus=2, transition=start + 9, heartbeat=NOW)
    timeline = boot_timeline(start, running, ready_node, gpus_seen_at=NOW)
    steps = {s["step"]: s["at"] for s in timeline}
    assert start <= steps["Running"] <= start + 3 and steps["Ready"] == start + 9
    assert steps["GPUs registered"] == NOW
    # a Ready condition from before this start is the previous boot's
    stale = boot_timeline(start, running, node("g", gpus=2, transition=start - 100), gpus_seen_at=NOW)
    assert [s["at"] is None for s in stale] == [False, False, True, True]


def test_gpus_registered_is_the_first_sighting_and_forgotten_when_the_node_leaves_ready():
    ready = views([node("a", gpus=1, heartbeat=NOW)], instances=[instance("a", start=NOW - 3600)])
    seen = observe_gpus({}, ready, NOW)
    assert seen == {"a": NOW}
    assert observe_gpus(seen, ready, NOW + 5) == {"a": NOW}
    stopped = views([node("a", gpus=1, ready="Unknown")], instances=[instance("a", "Stopped")])
    assert observe_gpus(seen, stopped, NOW + 10) == {}


def test_offerings_out_of_stock_and_failed_nodes_show_with_their_time_left():
    marks = [Unavailable("OperationDenied.NoStock", NOW + 300, instance_type="ecs.gn7i-c32g1.16xlarge",
                         zone="cn-hangzhou-h"),
             Unavailable("not GPU-ready in time", NOW + 60, node="g"),
             Unavailable("expired", NOW - 1, instance_type="ecs.x", zone="z")]
    data = fleet_view([], [], reservations=[], backed=(), marks=marks, starts={}, instances={}, gpus_seen={}, now=NOW)
    assert data["out_of_stock"] == [{"instance_type": "ecs.gn7i-c32g1.16xlarge", "zone": "cn-hangzhou-h",
                                     "reason": "OperationDenied.NoStock", "expires_at": NOW + 300, "left_seconds": 300}]
    assert [(m["node"], m["left_seconds"]) for m in data["node_marks"]] == [("g", 60)]


def test_a_runs_view_has_its_placement_table_and_boot_timeline():
    vs = views([node("s", gpus=2, ready="Unknown")], instances=[instance("s", "Stopped", gpus=2)])
    plan = place(JobRequest("gb-1", (TaskRequest("train", Resources({"nvidia.com/gpu": 2, "cpu": 1000})),), 1), vs)
    evidence = {"s": {"node": "s", "ready_since": "2027-01-15T08:00:09Z", "path": "reset seen",
                      "held_seconds": 5.0, "gpus_allocatable": 2, "summary": "booted s in 9.0 s"}}
    for key in ("baselines", "boots"):            # "boots": what the start step of gpuboot 0.1 pushed
        xcoms = {"gpu_job.place": {"return_value": plan.to_json()},
                 "gpu_job.start": {key: [{"node": "s", "start_requested_at": NOW, "gpus_needed": 2}],
                                   "plan": plan.to_json()},
                 "gpu_job.wait_gpu_ready": {"evidence": evidence}}    # node -> evidence, as the sensor pushes it
        data = run_view(xcoms, [{"task_id": "gpu_job.place", "state": "success"}])
        assert data["placement"]["outcome"] == "fits" and "TASK" in data["placement"]["table"]
        assert data["placement"]["nodes_to_start"] == ["s"]
        [boot] = data["boots"]
        assert boot["node"] == "s" and boot["start_requested_at"] == NOW
        assert boot["ready_since"] == parse_time("2027-01-15T08:00:09Z")      # the page's "Ready since"
        assert boot["evidence"]["path"] == "reset seen"
    assert run_view({}, [])["placement"] is None


def test_the_totals_add_up_per_gpu_model_and_the_money_is_what_the_running_nodes_cost():
    price = {"gpuboot.io/price-per-hour": "2.0"}
    nodes = [node("busy", gpus=2, heartbeat=NOW, labels=price), node("idle", gpus=2, heartbeat=NOW, labels=price),
             node("off", gpus=2, ready="Unknown", labels=price),
             node("a10", gpus=1, heartbeat=NOW, labels=price, gpu_model="NVIDIA-A10")]
    insts = [instance("busy", start=NOW - 3600, gpus=2), instance("idle", start=NOW - 3600, gpus=2),
             instance("off", "Stopped", gpus=2), instance("a10", start=NOW - 3600)]
    bound = pod("train-0", "busy", requests={"nvidia.com/gpu": "1"})
    held = [Reservation("gb-1", "train", "busy", Resources({"nvidia.com/gpu": 1}), NOW + 600)]
    vs = build_inventory(nodes, [bound], insts, TYPES, held, NOW)
    data = fleet_view(vs, nodes, reservations=held, backed=(), marks=[], starts={}, instances={}, gpus_seen={},
                      now=NOW)
    totals = data["totals"]
    assert totals["gpus"]["Tesla-T4"] == {"total": 6, "running": 1, "reserved": 1, "free": 2, "stopped": 2,
                                          "booting": 0, "unavailable": 0}
    assert totals["gpus"]["NVIDIA-A10"]["free"] == 1
    # every model's total is the sum of its nodes' GPUs in the nodes table
    for model, t in totals["gpus"].items():
        assert t["total"] == sum(n["gpus"]["total"] for n in data["nodes"] if n["gpu_model"] == model)
        assert t["total"] == sum(v for k, v in t.items() if k != "total")
    # three nodes up at 2.0 USD/h; idle: all of "idle", none of "busy", all of "a10"
    assert (totals["usd_per_hour"], totals["idle_usd_per_hour"]) == (6.0, 4.0)


def test_the_etag_moves_with_the_fleet_not_with_the_clock():
    def data(now, holds):
        reservations = [Reservation("gb-1", "train", "a", Resources({"nvidia.com/gpu": 1}), NOW + 600)][:holds]
        nodes = [node("a", gpus=2, heartbeat=now)]
        vs = build_inventory(nodes, [], [instance("a", start=NOW - 3600, gpus=2)], TYPES, reservations, now)
        return fleet_view(vs, nodes, reservations=reservations, backed=(), marks=[], starts={}, instances={},
                          gpus_seen={}, now=now)

    first, later = data(NOW, 1), data(NOW + 3, 1)
    assert first["reservations"][0]["expires_in_seconds"] != later["reservations"][0]["expires_in_seconds"]
    assert etag_of(first) == etag_of({**later, "surveys": 9}) and etag_of(first).startswith('W/"')
    assert etag_of(data(NOW + 3, 0)) != etag_of(first)          # the reservation gone: a change
