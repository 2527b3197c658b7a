"""A loopback TCP proxy that a test can cut and restore, to take a real server "down"."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Forwards 127.0.0.1:<port> to *target*. ``cut()`` closes every connection and refuses
    new ones, as a server that went away would; ``restore()`` accepts again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._listener.close()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server: socket.socket | None = None
        #: Reads from clients forwarded to the target (see _pipe).
        self.requests = 0
        self.restore()

    def restore(self) -> None:
        server = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        server.settimeout(0.2)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    close = cut

    def _accept(self, server: socket.socket) -> None:
        while self._server is server:
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b, upstream_bound in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, upstream_bound), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream_bound: bool) -> None:
        try:
            while data := source.recv(65536):
                if upstream_bound:
                    # A request-response client sends once per round trip (small requests
                    # arrive in one read): what a test counts as round trips.
                    self.requests += 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
