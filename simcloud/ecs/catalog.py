"""What the region sells, where and at what price: DescribePrice and DescribeAvailableResource.

Prices are the fleet file's `instance_types.TYPE.price_per_hour` (pay-as-you-go, per hour,
in CURRENCY, no discount): a type without one has no price, and DescribePrice refuses it
rather than invent one. Stock follows the NoStock fault, so what DescribeAvailableResource
calls SoldOut is exactly what StartInstances refuses with OperationDenied.NoStock: every
fleet type is offered in every zone of the fleet.
"""
from __future__ import annotations

from simcloud.ecs.model import EcsCloud, EcsError, InstanceType
from simcloud.ecs.params import Params, as_int, check_region, invalid, missing, one_of

CURRENCY = "USD"
RESOURCE_TYPES = ("instance", "disk", "diskperformance", "bandwidth", "ddh", "ElasticityAssurance",
                  "CapacityReservation")
SYSTEM_DISK_CATEGORIES = ("cloud", "cloud_efficiency", "cloud_ssd", "cloud_essd", "cloud_auto", "cloud_essd_entry")
DESTINATIONS = ("Zone", "IoOptimized", "InstanceType", "SystemDisk", "DataDisk", "Network", "ddh")


def unknown_type(type_id: str) -> EcsError:
    return EcsError("InvalidInstanceType.ValueNotSupported",
                    f"The specified InstanceType {type_id!r} does not exist or beyond the permitted range.", 400)


def price_of(cloud: EcsCloud, type_id: str) -> float:
    t = cloud.instance_types.get(type_id)
    if t is None:
        raise unknown_type(type_id)
    if t.price_per_hour is None:
        raise EcsError("PriceNotFound", f"The price of your queried resource is not found: {type_id} has no "
                       "price_per_hour in the fleet file.", 400)
    return float(t.price_per_hour)


def describe_price(params: Params, cloud: EcsCloud) -> dict:
    """ResourceType instance, pay-as-you-go, PriceUnit Hour: the only price a fleet file states.

    ZoneId, when given, must be a zone of the fleet (every zone sells at the fleet's price);
    SystemDisk.Category must be a real category. The price is the instance type's alone:
    simcloud does not price disks (the real answer adds a systemDisk DetailInfo)."""
    check_region(params, cloud)
    zone = params.get("ZoneId") or None
    if zone is not None and zone not in zones(cloud):
        raise invalid("ZoneId", zone, f"a zone of region {cloud.region_id}: {', '.join(zones(cloud)) or 'none'}")
    one_of(params, "SystemDisk.Category", SYSTEM_DISK_CATEGORIES)
    resource = one_of(params, "ResourceType", RESOURCE_TYPES, "instance")
    if resource != "instance":
        raise invalid("ResourceType", resource, "instance (simcloud prices only instances)")
    type_id = params.get("InstanceType")
    if not type_id:
        raise missing("InstanceType")
    unit = one_of(params, "PriceUnit", ("Hour", "Week", "Month", "Year"), "Hour")
    if unit != "Hour":
        raise invalid("PriceUnit", unit, "Hour (pay-as-you-go prices are per hour)")
    amount = as_int(params, "Amount", 1, 1, 1000)
    total = round(price_of(cloud, type_id) * amount, 4)
    price = {"OriginalPrice": total, "DiscountPrice": 0.0, "TradePrice": total}
    return {"PriceInfo": {
        "Price": {**price, "Currency": CURRENCY, "DetailInfos": {"DetailInfo": [
            {"Resource": "instanceType", **price}]}},
        "Rules": {"Rule": []}}}


def zones(cloud: EcsCloud) -> list[str]:
    return sorted({i.zone_id for i in cloud.instances.values()})


def _stock(cloud: EcsCloud, t: InstanceType, zone: str) -> tuple[str, str]:
    if cloud.faults.no_stock_for(t.instance_type_id, zone):
        return "SoldOut", "WithoutStock"
    return "Available", "WithStock"


def describe_available_resource(params: Params, cloud: EcsCloud) -> dict:
    """Per zone, the instance types (DestinationResource InstanceType) or the zone itself (Zone)."""
    check_region(params, cloud)
    destination = params.get("DestinationResource")
    if not destination:
        raise missing("DestinationResource")
    one_of(params, "DestinationResource", DESTINATIONS)
    if destination not in ("InstanceType", "Zone"):
        raise invalid("DestinationResource", destination, "InstanceType or Zone (what simcloud tracks)")
    one_of(params, "InstanceChargeType", ("PrePaid", "PostPaid"), "PostPaid")
    wanted_zone, wanted_type = params.get("ZoneId") or None, params.get("InstanceType") or None
    if wanted_type and wanted_type not in cloud.instance_types:
        raise unknown_type(wanted_type)
    types = [t for tid, t in sorted(cloud.instance_types.items()) if wanted_type in (None, tid)]
    out = []
    for zone in zones(cloud):
        if wanted_zone not in (None, zone):
            continue
        stock = [(t, *_stock(cloud, t, zone)) for t in types]
        in_stock = any(status == "Available" for _, status, _ in stock)
        zone_status = ("Available", "WithStock") if in_stock else ("SoldOut", "WithoutStock")
        if destination == "Zone":
            supported = [{"Value": zone, "Status": zone_status[0], "StatusCategory": zone_status[1]}]
        else:
            supported = [{"Value": t.instance_type_id, "Status": status, "StatusCategory": category}
                         for t, status, category in stock]
        out.append({"RegionId": cloud.region_id, "ZoneId": zone, "Status": zone_status[0],
                    "StatusCategory": zone_status[1], "AvailableResources": {"AvailableResource": [
                        {"Type": destination, "SupportedResources": {"SupportedResource": supported}}]}})
    return {"AvailableZones": {"AvailableZone": out}}
