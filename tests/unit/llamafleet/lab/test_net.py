"""Lab addressing and link-shaping arithmetic (pure)."""

from __future__ import annotations

import json

import pytest

from llamafleet.lab.net import LabHost, format_rate, lab_hosts, parse_rate, parse_tbf_rate, tbf_arguments
from llamafleet.lab.system import LabError


@pytest.mark.parametrize(
    ("index", "name", "address", "veth"),
    [(1, "lab1", "10.77.0.11", "vb-lab1"), (3, "lab3", "10.77.0.13", "vb-lab3"), (32, "lab32", "10.77.0.42", "vb-lab32")],
)
def test_host_addressing(index: int, name: str, address: str, veth: str) -> None:
    host = LabHost(index)
    assert (host.name, host.address, host.veth) == (name, address, veth)
    assert LabHost.from_name(name) == host


@pytest.mark.parametrize("name", ["lab0", "lab33", "lab01", "web1", "lab", "lab1x"])
def test_from_name_rejects_non_lab_names(name: str) -> None:
    with pytest.raises(LabError, match="not a lab host name"):
        LabHost.from_name(name)


def test_lab_hosts_bounds() -> None:
    assert [h.name for h in lab_hosts(3)] == ["lab1", "lab2", "lab3"]
    for bad in (0, 33):
        with pytest.raises(LabError, match="--hosts must be between 1 and 32"):
            lab_hosts(bad)


@pytest.mark.parametrize(
    ("rate", "bits"),
    [("30mbit", 30_000_000), ("500kbit", 500_000), ("1gbit", 10**9), ("1.5mbit", 1_500_000),
     ("4mbps", 32_000_000), ("8000bit", 8000), (" 30Mbit ", 30_000_000)],
)
def test_parse_rate(rate: str, bits: int) -> None:
    assert parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["30", "30mb", "fast", "-1mbit", "1000bit", "30 mbit"])
def test_parse_rate_rejects(rate: str) -> None:
    with pytest.raises(LabError):
        parse_rate(rate)


@pytest.mark.parametrize(("bits", "text"), [(30_000_000, "30mbit"), (10**9, "1gbit"), (1_500_000, "1500kbit"), (8001, "8001bit")])
def test_format_rate(bits: int, text: str) -> None:
    assert format_rate(bits) == text


def test_tbf_arguments_bucket_sizes() -> None:
    # 30 Mbit/s: 4 ms of traffic is 15000 bytes, below ten frames, so ten frames it is.
    assert tbf_arguments("30mbit") == ["root", "tbf", "rate", "30000000bit", "burst", "15140", "latency", "100ms"]
    # 1 Gbit/s: 4 ms is 500000 bytes.
    assert tbf_arguments("1gbit")[5] == "500000"


def test_parse_tbf_rate_from_recorded_tc_output() -> None:
    # `tc -json qdisc show dev vb-lab2` on the lab controller after `lab shape lab2 --rate 30mbit`.
    shaped = '[{"kind":"tbf","handle":"8001:","root":true,"refcnt":3,"options":{"rate":3750000,"burst":15138,"lat":100000}}]'
    assert parse_tbf_rate(shaped) == "30mbit"
    plain = json.dumps([{"kind": "noqueue", "handle": "0:", "root": True, "refcnt": 2, "options": {}}])
    assert parse_tbf_rate(plain) is None
    assert parse_tbf_rate("") is None
