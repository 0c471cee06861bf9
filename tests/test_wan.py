"""The wide-area emulator (p2pfusion/cli/wan.py) between two network namespaces: a round trip
takes twice the configured one-way delay, a bulk transfer the configured rate, both within 10%,
and a changed matrix holds for connections already open."""

import json
import subprocess
import sys
import time

import pytest

from p2pfusion.cli.hosts import HostNetwork, namespaces_unavailable
from p2pfusion.cli.wan import write_matrix

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))

PORT = 47011
MBIT = 8
# on the far host: 1 byte answers a byte; after a 0xff byte, it counts BULK bytes and then answers
SERVER = """
import socket, sys
BULK = int(sys.argv[1])
with socket.create_server(("127.0.0.1", %d)) as server:
    conn, _ = server.accept()
    while True:
        first = conn.recv(1)
        if not first:
            break
        if first == b"\\xff":
            left = BULK
            while left:
                left -= len(conn.recv(min(left, 1 << 16)))
        conn.sendall(b"k")
""" % PORT
# on the near host: round trips, then a bulk send; prints what it measured
CLIENT = """
import json, socket, statistics, sys, time
host, bulk = sys.argv[1], int(sys.argv[2])
for _ in range(50):
    try:
        conn = socket.create_connection((host, %d), timeout=5)
        break
    except OSError:
        time.sleep(0.1)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
def trip():
    t = time.perf_counter(); conn.sendall(b"p"); conn.recv(1); return time.perf_counter() - t
trip()
rtts = [trip() for _ in range(8)]
sys.stdout.write(json.dumps({"rtt": statistics.median(rtts)}) + "\\n"); sys.stdout.flush()
sys.stdin.readline()  # the matrix changed: round trips again, on the same connection
rtts2 = [trip() for _ in range(8)]
t = time.perf_counter(); conn.sendall(b"\\xff" + bytes(bulk)); conn.recv(1); seconds = time.perf_counter() - t
print(json.dumps({"rtt2": statistics.median(rtts2), "bulk_seconds": seconds}))
""" % PORT


def test_round_trips_and_rate_match_the_configuration(tmp_path):
    bulk = MBIT * 125_000  # one second's worth at the rate
    matrix = tmp_path / "matrix.json"
    with HostNetwork(2, prefix="p2pfw", subnet="10.79.0", mbit=MBIT) as net:
        write_matrix(matrix, {net.host(0): 0.020})
        server = subprocess.Popen([*net.prefix_of(1), sys.executable, "-c", SERVER, str(bulk)])
        relay = subprocess.Popen([*net.prefix_of(1), sys.executable, "-m", "p2pfusion.cli.wan", "--host", net.host(1),
                                  "--ports", str(PORT), "--matrix", str(matrix)])
        try:
            client = subprocess.Popen([*net.prefix_of(0), sys.executable, "-c", CLIENT, net.host(1), str(bulk)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            first = json.loads(client.stdout.readline())
            write_matrix(matrix, {net.host(0): 0.050})
            time.sleep(0.5)  # relays look at the file every 0.2 s
            client.stdin.write("\n")
            client.stdin.flush()
            second = json.loads(client.stdout.readline())
            client.wait(30)
        finally:
            for proc in (relay, server):
                proc.kill()
                proc.wait()
    assert 0.040 * 0.9 <= first["rtt"] <= 0.040 * 1.1, first
    assert 0.100 * 0.9 <= second["rtt2"] <= 0.100 * 1.1, second
    # the transfer: one second at the rate, plus a one-way delay out and the answer's back
    rate_seconds = second["bulk_seconds"] - second["rtt2"]
    assert 0.9 <= rate_seconds <= 1.1 / 0.9, second
