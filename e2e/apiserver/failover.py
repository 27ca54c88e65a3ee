#!/usr/bin/env python3
"""What the operator's Service does for the eviction check in a cluster, for the core stories
(e2e/tests/apiserver/stories.rs): listens on LISTEN (host:port) and hands each TCP connection to the first of the
BACKENDS that accepts one (TLS passes through untouched: the webhook's certificate is for 127.0.0.1). A replica that is down refuses at once, as a
Service's endpoint that is not ready is left out. Each connection is logged with the backend it went to.

    failover.py LISTEN BACKEND...
"""
import socket
import sys
import threading


def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def address(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main():
    listen, backends = address(sys.argv[1]), [address(b) for b in sys.argv[2:]]
    server = socket.create_server(listen, reuse_port=False)
    print(f"listening on {listen[0]}:{listen[1]}", flush=True)
    while True:
        client, _ = server.accept()
        for backend in backends:
            try:
                upstream = socket.create_connection(backend, timeout=2)
            except OSError:
                continue
            upstream.settimeout(None)
            print(f"connection -> {backend[0]}:{backend[1]}", flush=True)
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
            break
        else:
            print("connection refused: no backend", flush=True)
            client.close()


if __name__ == "__main__":
    main()
