#!/usr/bin/python3
"""Opens N idle connections to a router (in 2 processes), then times fresh requests.

Usage: scripts/http-idle-flood.py PORT N   (docs/security.md, "Measured"; each of the two
client processes holds N/2 sockets, so ulimit -n must allow that)
"""
import multiprocessing as mp, socket, sys, time

def hold(port, n, ready, done):
    socks, failed = [], 0
    for _ in range(n):
        s = socket.socket()
        s.settimeout(1.0)
        try:
            s.connect(("127.0.0.1", port))
            socks.append(s)
        except OSError:
            failed += 1
            s.close()
    ready.put((len(socks), failed))
    done.wait()
    # how many of ours the server closed
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    ready.put(closed)

def probe(port):
    t = time.time()
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            b = c.recv(4096)
            if not b:
                break
            data += b
        ok = data.startswith(b"HTTP/1.1 200")
    except OSError as e:
        ok = False
    return ok, time.time() - t

if __name__ == "__main__":
    port, n = int(sys.argv[1]), int(sys.argv[2])
    ready, done = mp.Queue(), mp.Event()
    t0 = time.time()
    procs = [mp.Process(target=hold, args=(port, n // 2, ready, done)) for _ in range(2)]
    for p in procs: p.start()
    got = [ready.get() for _ in procs]
    print(f"opened {sum(g[0] for g in got)} idle connections ({sum(g[1] for g in got)} connects failed) in {time.time()-t0:.1f} s")
    res = [probe(port) for _ in range(5)]
    print("fresh clients: " + ", ".join(f"{'200' if ok else 'FAIL'} in {dt*1000:.0f} ms" for ok, dt in res))
    done.set()
    closed = sum(ready.get() for _ in procs)
    print(f"server had closed {closed} of the idle connections")
    for p in procs: p.join()
