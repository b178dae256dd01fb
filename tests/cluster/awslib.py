"""Helpers for the tests against moto's EC2 server (its fixtures, ``moto_url`` and ``env``: conftest.py):
reading the emulated account back through a separate boto3 client, and a proxy in front of moto that
can answer a call the way the real EC2 would have."""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse

import boto3

REGION = "us-east-1"
CIDR = "203.0.113.7/32"


def ec2(region: str = REGION):
    return boto3.session.Session(region_name=region).client("ec2")


def live_instances(name: str) -> list[dict]:
    out = []
    for res in ec2().describe_instances(Filters=[{"Name": "tag:xeontune-cluster", "Values": [name]}])["Reservations"]:
        out += [i for i in res["Instances"] if i["State"]["Name"] != "terminated"]
    return out


def leftovers(name: str) -> dict[str, list]:
    c = ec2()
    by_tag = [{"Name": "tag:xeontune-cluster", "Values": [name]}]
    return {
        "instances": [i["InstanceId"] for i in live_instances(name)],
        "security_groups": [g["GroupId"] for g in c.describe_security_groups()["SecurityGroups"]
                            if g["GroupName"] == f"xeontune-{name}"]
        + [g["GroupId"] for g in c.describe_security_groups(Filters=by_tag)["SecurityGroups"]],
        "key_pairs": [k["KeyName"] for k in c.describe_key_pairs()["KeyPairs"] if k["KeyName"].startswith("xeontune-")],
    }


def up_argv(name: str, n: int = 3, *extra: str) -> list[str]:
    return ["cluster", "up", "--provider", "aws", "-n", str(n), "--name", name, "--region", REGION,
            "--ssh-cidr", CIDR, "--skip-bootstrap", *extra]


class Proxy(http.server.ThreadingHTTPServer):
    """Forwards to moto; ``answer(action, n)`` may replace the n-th call of an action with its own
    (status, XML) reply, the way the real EC2 would have answered."""

    def __init__(self, upstream: str, answer) -> None:
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.answer = answer
        self.counts: dict[str, int] = {}

    def __enter__(self) -> str:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: Proxy

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, data: bytes, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        action = (urllib.parse.parse_qs(body.decode()).get("Action") or [""])[0]
        self.server.counts[action] = self.server.counts.get(action, 0) + 1
        mine = self.server.answer(action, self.server.counts[action], urllib.parse.parse_qs(body.decode()))
        if mine is not None:
            return self._reply(mine[0], mine[1], [("Content-Type", "text/xml")])
        conn = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request("POST", self.path, body, headers)
        resp = conn.getresponse()
        self._reply(resp.status, resp.read(), resp.getheaders())


def ec2_error(code: str, message: str) -> tuple[int, bytes]:
    return 400, (f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
                 f"<Message>{message}</Message></Error></Errors><RequestID>r</RequestID></Response>").encode()
