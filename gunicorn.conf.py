"""gunicorn settings for the gateway in production.

    gunicorn -c gunicorn.conf.py cosyvoice.webui:app

Everything comes from the same COSYVOICE_* variables as the rest of cosyvoice (see the
the table in docs/configuration.md): bind address and port, processes, timeouts, log level.
The gateway accepts WebSocket connections only, so each connection lives in exactly one
process and ``workers`` may be any number; several instances sit behind nginx.

Metrics: every process writes its metrics to PROMETHEUS_MULTIPROC_DIR (a fresh temporary
directory unless set), emptied when the instance starts; ``/metrics`` adds them up.
"""

import sys

from cosyvoice import logs, metrics_dir
from cosyvoice.settings import Settings, SettingsError

try:
    _settings = Settings.from_env()
except SettingsError as _exc:  # one line and the usage status, as `cosyvoice` gives
    print(f"gunicorn.conf.py: {_exc}", file=sys.stderr)
    sys.exit(2)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


bind = [_address(_settings.host, _settings.port)]
workers = _settings.gateway_processes
# With gevent-websocket installed, the plain gevent worker refuses WebSocket upgrades.
# gevent-websocket's worker, with a check before each raw WebSocket upgrade
# (cosyvoice/gateway/wshandler.py: a bad key is refused with 401 before the 101)
worker_class = "cosyvoice.gateway.wshandler.Worker"
# Concurrent connections per process: each is one streaming session.
worker_connections = 1000
# Replace a process after about this many connections (bounds slow leaks); the jitter
# keeps the processes of one instance from restarting together. Its sessions resume.
max_requests = 10000
max_requests_jitter = 500
# A process that does not report for this long is killed and replaced.
timeout = _settings.gateway_timeout_s
# SIGTERM: stop accepting, let requests finish this long, then close the rest (those
# clients resume within the session grace period, on another instance).
graceful_timeout = _settings.gateway_graceful_timeout_s
keepalive = 5
# gunicorn 27 would open a control socket under ~/.gunicorn; nothing here uses it.
control_socket_disable = True

# The gateway's and gunicorn's own logs, as JSON lines on stderr.
loglevel = logs.level_name(_settings.log_level).lower()
logconfig_dict = logs.dict_config(_settings.log_level)
accesslog = None  # one WebSocket per session: nginx's access log says more
logs.setup(_settings.log_level)

_metrics_path, _metrics_created = metrics_dir.choose("gateway")


def on_starting(server):
    metrics_dir.clear(_metrics_path)


def child_exit(server, worker):
    metrics_dir.mark_dead(worker.pid, _metrics_path)


def on_exit(server):
    if _metrics_created:
        metrics_dir.remove(_metrics_path)
