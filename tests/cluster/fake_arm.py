"""A fake Azure Resource Manager endpoint on loopback, over HTTPS, for the azure provider's tests.

It implements only the ARM REST calls the provider makes, with ARM's own shapes: resource groups
(tags, ``$filter`` by tag, asynchronous delete with a ``Location`` to poll), network security
groups, virtual networks with subnets, public IPs, NICs and VMs (``PUT`` answered ``201`` with an
``Azure-AsyncOperation`` to poll, as ARM does), the compute SKU list and the image offer list.
It checks what ARM checks that matters here: the bearer token, the location, the VM size, the
references between resources, and a per-location vCPU quota. Errors come back as ARM's
``{"error": {"code", "message"}}``.

The Azure SDK talks to it through its own transport (requests, TLS with the certificate this
module writes); nothing is mocked inside the SDK.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import re
import ssl
import threading
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKEN = "fake-arm-token"
LOCATIONS = ("eastus", "westeurope")
SIZES = {"Standard_D16s_v6": 16, "Standard_D4s_v6": 4, "Standard_D8s_v6": 8, "Standard_B2s": 2}
CANONICAL_OFFERS = ("0001-com-ubuntu-server-jammy", "ubuntu-24_04-lts", "ubuntu-24_04-lts-daily", "ubuntu-25_10",
                    "ubuntu-26_04-lts", "ubuntu-pro-26_04-lts")

_RG_RE = re.compile(r"^/subscriptions/([^/]+)/resourcegroups/([^/]+)$", re.I)
_RUN_RE = re.compile(r"^/subscriptions/([^/]+)/resourcegroups/([^/]+)/providers/microsoft\.compute/virtualmachines/([^/]+)/runcommand$", re.I)
_RES_RE = re.compile(r"^/subscriptions/([^/]+)/resourcegroups/([^/]+)/providers/([^/]+)/([^/]+)(?:/([^/]+))?$", re.I)


def write_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the client trusts exactly this file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-arm")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "fake-arm.pem", directory / "fake-arm.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@dataclass
class _Operation:
    polls_left: int
    on_done: Any = None  # called once when the operation completes
    status: str = "InProgress"
    result: Any = None  # the body of the final 200, for an operation that returns one


@dataclass
class FakeArm:
    """The server's state; tests read ``resources`` and ``requests`` directly."""

    quota_vcpus: int = 64
    resource_groups: dict[str, dict] = field(default_factory=dict)  # lower-case name -> body
    resources: dict[str, dict] = field(default_factory=dict)  # lower-case id -> body
    operations: dict[str, _Operation] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_ip: int = 4
    host_keys: dict[str, str] = field(default_factory=dict)  # VM name -> what its sshd would present
    delete_polls: int = 2  # how many polls a resource group's delete stays in progress

    def in_group(self, rg: str) -> list[dict]:
        prefix = f"/resourcegroups/{rg.lower()}/"
        return [r for k, r in self.resources.items() if prefix in k]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

    def log_message(self, *args: Any) -> None:
        pass

    # --- plumbing --------------------------------------------------------------------------------

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-ms-request-id", str(uuid.uuid4()))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, {"error": {"code": code, "message": message}})

    def _base(self) -> str:
        return f"https://127.0.0.1:{self.server.server_address[1]}"

    def _handle(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        arm = self.server.arm
        with arm.lock:
            arm.requests.append((self.command, url.path))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "InvalidAuthenticationToken", "The access token is invalid.")
        if "api-version" not in query:
            return self._error(400, "MissingApiVersionParameter", "The api-version query parameter is required.")
        with arm.lock:
            self._route(url.path, query, body)

    do_GET = do_PUT = do_DELETE = do_POST = do_HEAD = do_PATCH = _handle

    # --- routes ----------------------------------------------------------------------------------

    def _route(self, path: str, query: dict[str, str], body: Any) -> None:
        arm = self.server.arm
        parts = path.strip("/").split("/")
        low = [p.lower() for p in parts]
        if len(parts) == 4 and low[2] == "operations":  # /subscriptions/s/operations/<id>  (our async ops)
            return self._operation(parts[3], location_style=False)
        if len(parts) == 4 and low[2] == "operationresults":
            return self._operation(parts[3], location_style=True)
        if len(parts) == 3 and low[2] == "resourcegroups" and self.command == "GET":
            return self._list_groups(query)
        if len(parts) == 5 and low[2:] == ["providers", "microsoft.compute", "skus"]:
            return self._skus(query)
        if len(parts) >= 10 and low[2:4] == ["providers", "microsoft.compute"] and low[-1] == "offers":
            return self._offers(parts[5], parts[7])
        m = _RUN_RE.match(path)
        if m and self.command == "POST":
            return self._run_command(*m.groups(), body)
        m = _RG_RE.match(path)
        if m:
            return self._group(m.group(2), body)
        m = _RES_RE.match(path)
        if m:
            _, rg, ns, rtype, name = m.groups()
            if name is None:  # a list of one type in a group
                items = [r for r in arm.in_group(rg) if r["type"].lower() == f"{ns}/{rtype}".lower()]
                return self._send(200, {"value": items})
            return self._resource(rg, ns, rtype, name, path, query, body)
        return self._error(404, "NotFound", f"no route for {self.command} {path} in the fake ARM")

    def _operation(self, op_id: str, location_style: bool) -> None:
        op = self.server.arm.operations.get(op_id)
        if op is None:
            return self._error(404, "NotFound", f"operation {op_id}")
        if op.polls_left > 0:
            op.polls_left -= 1
            if location_style:
                return self._send(202, None, {"Location": f"{self._base()}{self.path}", "Retry-After": "0"})
            return self._send(200, {"status": "InProgress"}, {"Retry-After": "0"})
        if op.on_done is not None:
            op.on_done()
            op.on_done = None
        op.status = "Succeeded"
        if location_style:
            return self._send(200, op.result)
        return self._send(200, {"status": "Succeeded"})

    def _new_operation(self, polls: int, on_done: Any = None, result: Any = None) -> str:
        op_id = uuid.uuid4().hex
        self.server.arm.operations[op_id] = _Operation(polls, on_done, result=result)
        return op_id

    def _run_command(self, sub: str, rg: str, vm: str, body: Any) -> None:
        """Runs nothing: answers a ``cat`` of the ed25519 host key with the key the test set."""
        arm = self.server.arm
        if f"/subscriptions/{sub}/resourcegroups/{rg}/providers/microsoft.compute/virtualmachines/{vm}".lower() \
                not in arm.resources:
            return self._error(404, "ResourceNotFound", f"VM {vm} not found")
        script = " ".join((body or {}).get("script") or [])
        key = arm.host_keys.get(vm)
        if "ssh_host_ed25519_key.pub" not in script or (body or {}).get("commandId") != "RunShellScript":
            return self._error(400, "InvalidParameter", "the fake runs only the host-key command")
        stdout = f"{key} root@{vm}\n" if key else ""
        result = {"value": [{"code": "ProvisioningState/succeeded", "level": "Info", "displayStatus": "Provisioning succeeded",
                             "message": f"Enable succeeded: \n[stdout]\n{stdout}\n[stderr]\n"}]}
        op = self._new_operation(polls=1, result=result)
        self._send(202, None, {"Location": f"{self._base()}/subscriptions/{sub}/operationresults/{op}?api-version=2024-01-01",
                               "Retry-After": "0"})

    def _list_groups(self, query: dict[str, str]) -> None:
        groups = list(self.server.arm.resource_groups.values())
        flt = query.get("$filter", "")
        m = re.match(r"tagName eq '([^']*)' and tagValue eq '([^']*)'", flt)
        if m:
            groups = [g for g in groups if (g.get("tags") or {}).get(m.group(1)) == m.group(2)]
        elif flt:
            return self._error(400, "InvalidFilter", f"unsupported filter {flt!r}")
        self._send(200, {"value": groups})

    def _skus(self, query: dict[str, str]) -> None:
        m = re.match(r"location eq '([^']*)'", query.get("$filter", ""))
        loc = m.group(1) if m else None
        skus = []
        for location in LOCATIONS:
            if loc and loc.lower() != location:
                continue
            for size, vcpus in SIZES.items():
                skus.append({"resourceType": "virtualMachines", "name": size, "tier": "Standard",
                             "family": "standardDSv6Family", "locations": [location],
                             "capabilities": [{"name": "vCPUs", "value": str(vcpus)},
                                              {"name": "vCPUsPerCore", "value": "2"},
                                              {"name": "MemoryGB", "value": str(vcpus * 4)}], "restrictions": []})
        self._send(200, {"value": skus})

    def _offers(self, location: str, publisher: str) -> None:
        if location.lower() not in LOCATIONS:
            return self._error(404, "NoRegisteredProviderFound", f"No registered resource provider found for location '{location}'.")
        offers = CANONICAL_OFFERS if publisher.lower() == "canonical" else ()
        self._send(200, [{"name": o, "location": location,
                          "id": f"/Subscriptions/x/Providers/Microsoft.Compute/Locations/{location}/Publishers/{publisher}/ArtifactTypes/VMImage/Offers/{o}"}
                         for o in offers])

    def _group(self, rg: str, body: Any) -> None:
        arm = self.server.arm
        key = rg.lower()
        sub = self.path.split("/")[2]
        if self.command == "PUT":
            location = (body or {}).get("location", "")
            if location.lower() not in LOCATIONS:
                return self._error(400, "LocationNotAvailableForResourceGroup",
                                   f"The provided location '{location}' is not available for resource group. "
                                   f"List of available regions is '{','.join(LOCATIONS)}'.")
            created = key not in arm.resource_groups
            arm.resource_groups[key] = {
                "id": f"/subscriptions/{sub}/resourceGroups/{rg}", "name": rg, "type": "Microsoft.Resources/resourceGroups",
                "location": location, "tags": body.get("tags") or {}, "properties": {"provisioningState": "Succeeded"}}
            return self._send(201 if created else 200, arm.resource_groups[key])
        group = arm.resource_groups.get(key)
        if group is None:
            return self._error(404, "ResourceGroupNotFound", f"Resource group '{rg}' could not be found.")
        if self.command in ("GET", "HEAD"):
            return self._send(200 if self.command == "GET" else 204, group if self.command == "GET" else None)
        if self.command == "DELETE":
            group["properties"]["provisioningState"] = "Deleting"

            def done() -> None:
                for k in [k for k in arm.resources if f"/resourcegroups/{key}/" in k]:
                    del arm.resources[k]
                arm.resource_groups.pop(key, None)

            op = self._new_operation(polls=arm.delete_polls, on_done=done)
            return self._send(202, None, {"Location": f"{self._base()}/subscriptions/{sub}/operationresults/{op}?api-version=2024-01-01",
                                          "Retry-After": "0"})
        return self._error(405, "MethodNotAllowed", self.command)

    def _resource(self, rg: str, ns: str, rtype: str, name: str, path: str, query: dict[str, str], body: Any) -> None:
        arm = self.server.arm
        key = path.lower()
        if rg.lower() not in arm.resource_groups:
            return self._error(404, "ResourceGroupNotFound", f"Resource group '{rg}' could not be found.")
        if self.command == "GET":
            res = arm.resources.get(key)
            if res is None:
                return self._error(404, "ResourceNotFound", f"The Resource '{ns}/{rtype}/{name}' under resource group '{rg}' was not found.")
            res = json.loads(json.dumps(res))
            if rtype.lower() == "virtualmachines" and query.get("$expand") == "instanceView":
                res["properties"]["instanceView"] = {"statuses": [{"code": "ProvisioningState/succeeded"},
                                                                  {"code": "PowerState/running"}]}
            return self._send(200, res)
        if self.command == "DELETE":
            arm.resources.pop(key, None)
            return self._send(200, None)
        if self.command != "PUT":
            return self._error(405, "MethodNotAllowed", self.command)
        body = dict(body or {})
        location = str(body.get("location", "")).lower()
        if location not in LOCATIONS:
            return self._error(400, "LocationNotAvailableForResourceType", f"The provided location '{location}' is not available.")
        props = body.setdefault("properties", {})
        error = self._check(rtype.lower(), location, props)
        if error:
            return self._error(*error)
        sub = path.split("/")[2]
        rid = f"/subscriptions/{sub}/resourceGroups/{rg}/providers/{ns}/{rtype}/{name}"
        body.update({"id": rid, "name": name, "type": f"{ns}/{rtype}"})
        self._fill(rtype.lower(), rid, props)
        created = key not in arm.resources
        props["provisioningState"] = "Succeeded"
        arm.resources[key] = body
        reply = json.loads(json.dumps(body))
        reply["properties"]["provisioningState"] = "Creating" if created else "Updating"
        op = self._new_operation(polls=1)
        self._send(201 if created else 200, reply, {
            "Azure-AsyncOperation": f"{self._base()}/subscriptions/{sub}/operations/{op}?api-version=2024-01-01",
            "Retry-After": "0"})

    def _exists(self, rid: str | None) -> bool:
        if not rid:
            return False
        arm = self.server.arm
        m = re.match(r"^(.*/virtualnetworks/[^/]+)/subnets/([^/]+)$", rid.lower())
        if m:
            vnet = arm.resources.get(m.group(1))
            return bool(vnet) and any(s["name"].lower() == m.group(2) for s in vnet["properties"].get("subnets", []))
        return rid.lower() in arm.resources

    def _check(self, rtype: str, location: str, props: dict) -> tuple[int, str, str] | None:
        arm = self.server.arm
        if rtype == "networkinterfaces":
            for cfg in props.get("ipConfigurations", []):
                p = cfg.get("properties", {})
                if not self._exists(p.get("subnet", {}).get("id")):
                    return 400, "InvalidResourceReference", f"Subnet {p.get('subnet')} referenced by the NIC was not found."
                if "publicIPAddress" in p and not self._exists(p["publicIPAddress"].get("id")):
                    return 400, "InvalidResourceReference", "Public IP referenced by the NIC was not found."
        if rtype == "virtualnetworks":
            for s in props.get("subnets", []):
                nsg = s.get("properties", {}).get("networkSecurityGroup")
                if nsg and not self._exists(nsg.get("id")):
                    return 400, "InvalidResourceReference", "NSG referenced by the subnet was not found."
        if rtype == "virtualmachines":
            size = props.get("hardwareProfile", {}).get("vmSize")
            if size not in SIZES:
                return 400, "InvalidParameter", f"The value {size} provided for the VM size is not valid."
            for nic in props.get("networkProfile", {}).get("networkInterfaces", []):
                if not self._exists(nic.get("id")):
                    return 400, "InvalidResourceReference", "NIC referenced by the VM was not found."
            used = sum(SIZES[r["properties"]["hardwareProfile"]["vmSize"]] for r in arm.resources.values()
                       if r["type"].lower() == "microsoft.compute/virtualmachines" and r["location"].lower() == location)
            if used + SIZES[size] > arm.quota_vcpus:
                return 409, "OperationNotAllowed", (
                    f"Operation could not be completed as it results in exceeding approved standardDSv6Family Cores "
                    f"quota. Location: {location}, Current Limit: {arm.quota_vcpus}, Current Usage: {used}, "
                    f"Additional Required: {SIZES[size]}.")
        return None

    def _fill(self, rtype: str, rid: str, props: dict) -> None:
        """What ARM adds to a resource on creation: ids of children, addresses."""
        arm = self.server.arm
        if rtype == "virtualnetworks":
            for s in props.get("subnets", []):
                s["id"] = f"{rid}/subnets/{s['name']}"
                s.setdefault("properties", {})["provisioningState"] = "Succeeded"
        if rtype == "publicipaddresses":
            props["ipAddress"] = f"20.0.0.{arm.next_ip}"
            arm.next_ip += 1
        if rtype == "networkinterfaces":
            for cfg in props.get("ipConfigurations", []):
                cfg["id"] = f"{rid}/ipConfigurations/{cfg['name']}"
                cfg.setdefault("properties", {})["privateIPAddress"] = f"10.42.0.{arm.next_ip}"
                arm.next_ip += 1
        if rtype == "virtualmachines":
            props["vmId"] = str(uuid.uuid4())
        if rtype == "networksecuritygroups":
            for r in props.get("securityRules", []):
                r["id"] = f"{rid}/securityRules/{r['name']}"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, arm: FakeArm) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.arm = arm


class FakeArmServer:
    """``with FakeArmServer(tmp) as srv:`` -> ``srv.url``, ``srv.ca`` (trust this file), ``srv.arm``."""

    def __init__(self, cert_dir: Path) -> None:
        self.arm = FakeArm()
        self.ca, key = write_certificate(cert_dir)
        self._server = _Server(self.arm)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.ca, key)
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def reset(self) -> None:
        with self.arm.lock:
            quota = self.arm.quota_vcpus
            self.arm.__init__()  # type: ignore[misc]
            self.arm.quota_vcpus = quota

    def __enter__(self) -> FakeArmServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
