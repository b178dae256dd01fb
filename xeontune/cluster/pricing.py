"""Estimated hourly cost of a cloud cluster, from a small table of list prices.

The figures are on-demand Linux list prices in USD (AWS us-east-1, Azure eastus), checked
2026-11. Other regions usually cost 0-20% more; spot is usually 50-70% less but varies by the
hour, so a spot cluster is shown at the on-demand price as an upper bound. Storage and public
addresses are included; data transfer is not. It is an estimate for planning, not a bill.
"""

from __future__ import annotations

from dataclasses import dataclass

# USD per hour, on demand, Linux.
AWS_INSTANCE_USD_H: dict[str, float] = {
    "m7i.large": 0.1008,
    "m7i.xlarge": 0.2016,
    "m7i.2xlarge": 0.4032,
    "m7i.4xlarge": 0.8064,
    "m7i.8xlarge": 1.6128,
    "m7i.12xlarge": 2.4192,
    "m7i.16xlarge": 3.2256,
    "c7i.2xlarge": 0.357,
    "c7i.4xlarge": 0.714,
    "c7i.8xlarge": 1.428,
    "r7i.4xlarge": 1.0584,
    "m6i.4xlarge": 0.768,
    "c6i.4xlarge": 0.68,
    "t3.micro": 0.0104,
    "t3.medium": 0.0416,
}
AWS_GP3_USD_GB_MONTH = 0.08
AWS_PUBLIC_IPV4_USD_H = 0.005

AZURE_SIZE_USD_H: dict[str, float] = {
    "Standard_D4s_v6": 0.202,
    "Standard_D8s_v6": 0.404,
    "Standard_D16s_v6": 0.808,
    "Standard_D32s_v6": 1.616,
    "Standard_D16s_v5": 0.768,
    "Standard_F16s_v2": 0.677,
    "Standard_B2s": 0.0416,
}
AZURE_PREMIUM_SSD_64GB_USD_MONTH = 9.29  # P6
AZURE_PUBLIC_IP_USD_H = 0.005

HOURS_PER_MONTH = 730.0


@dataclass
class CostEstimate:
    usd_per_hour: float | None  # None when a price is unknown
    detail: str  # one line: what the figure is made of

    def line(self) -> str:
        if self.usd_per_hour is None:
            return f"estimated cost: unknown ({self.detail})"
        return f"estimated cost: ${self.usd_per_hour:.2f}/hour ({self.detail})"


def aws(instance_type: str, nodes: int, disk_gb: int, spot: bool = False) -> CostEstimate:
    price = AWS_INSTANCE_USD_H.get(instance_type)
    disk = AWS_GP3_USD_GB_MONTH * disk_gb / HOURS_PER_MONTH
    ip = AWS_PUBLIC_IPV4_USD_H
    kind = "spot, at most the on-demand price" if spot else "on-demand list price, us-east-1"
    if price is None:
        return CostEstimate(None, f"no price on file for {instance_type}; {nodes} nodes")
    total = nodes * (price + disk + ip)
    return CostEstimate(total, f"{nodes} x {instance_type} at ${price:.4f}/h + {disk_gb} GB gp3 + public IPv4 each; {kind}")


def azure(size: str, nodes: int, public_ips: int = 1) -> CostEstimate:
    price = AZURE_SIZE_USD_H.get(size)
    if price is None:
        return CostEstimate(None, f"no price on file for {size}; {nodes} nodes")
    disk = AZURE_PREMIUM_SSD_64GB_USD_MONTH / HOURS_PER_MONTH
    total = nodes * (price + disk) + public_ips * AZURE_PUBLIC_IP_USD_H
    return CostEstimate(
        total, f"{nodes} x {size} at ${price:.3f}/h + 64 GB Premium SSD each + {public_ips} public IP; list price, eastus"
    )
