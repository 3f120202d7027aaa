"""`helios top`: a terminal dashboard over a running server's GET /metrics?format=json.

view.py turns two samples into sections and draws them (pure); terminal.py fetches, reads
keys and redraws.
"""

from helios.top.terminal import Sampler, Unreachable, fetch, metrics_url, run
from helios.top.view import History, Row, Section, Status, dashboard, plain, sections, spark

__all__ = [
    "History",
    "Row",
    "Sampler",
    "Section",
    "Status",
    "Unreachable",
    "dashboard",
    "fetch",
    "metrics_url",
    "plain",
    "run",
    "sections",
    "spark",
]
