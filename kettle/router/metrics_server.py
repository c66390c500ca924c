"""The `--prometheus-port` listener: the same metrics as `/metrics`, on a port of their own (TGI's default 9000).

A separate port lets a scraper reach the metrics when the API port sits behind an API key or a proxy. It runs
in a daemon thread with the standard library's HTTP server: scrapes are rare and small, and they must not
wait behind the event loop. A port already taken only costs a warning (the API keeps serving, and `/metrics`
still answers); `--prometheus-port 0` turns the listener off.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from kettle.router import metrics

logger = logging.getLogger(__name__)


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET (any path) → the Prometheus text exposition with TGI's sample names."""

    def do_GET(self) -> None:
        body = metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # Scrapes every few seconds would flood the log; errors still go through log_error → here at DEBUG.
        logger.debug("metrics scrape: " + format, *args)


def start_metrics_server(host: str, port: int) -> ThreadingHTTPServer | None:
    """Serves the metrics on `host:port` from a daemon thread; None when off (port 0) or the port is taken."""
    if port == 0:
        return None
    try:
        server = ThreadingHTTPServer((host, port), _MetricsHandler)
    except OSError as error:
        logger.warning("Prometheus port %d unavailable (%s): metrics only on /metrics", port, error.strerror or error)
        return None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kettle-metrics", daemon=True).start()
    logger.info("Prometheus metrics on http://%s:%d/metrics", host, port)
    return server
