"""Reading a Prometheus text endpoint (Triton's metrics port, vLLM's /metrics): the one parser.

    samples = scrape(server.metrics_url)
    total(samples, "nv_inference_request_success", model="prefillonly")   # summed over the other labels
    by_series(samples)["prefillonly_waiting_requests"]                    # {'name{labels}': value}

The tests and perf/ all read metrics through it (`scrape_metrics`: a server's series by name).
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from typing import NamedTuple

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Sample(NamedTuple):
    name: str
    labels: dict
    value: float
    series: str  # name and label text as the endpoint wrote them: 'name{a="x",b="y"}'


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (comments and unparsable values skipped)."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            label_text = m.group(2) or ""
            samples.append(Sample(m.group(1), dict(_LABEL.findall(label_text)), value, m.group(1) + label_text))
    return samples


def fetch(url: str, timeout_s: float = 10.0, attempts: int = 1, retry_pause_s: float = 0.2) -> str:
    """The endpoint's text; a refused connection is retried `attempts` times in all (a metrics
    port may open a moment after the server reports ready)."""
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                return r.read().decode()
        except urllib.error.URLError:
            if attempt == attempts - 1:
                raise
            time.sleep(retry_pause_s)
    raise ValueError("attempts must be at least 1")


def scrape(url: str, timeout_s: float = 10.0, attempts: int = 1) -> list[Sample]:
    return parse(fetch(url, timeout_s, attempts))


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0.0 when there are none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def by_series(samples: list[Sample], prefixes: tuple[str, ...] | None = None) -> dict[str, float]:
    """{'name{labels}': value} for the series whose text starts with one of `prefixes` (None: all)."""
    return {s.series: s.value for s in samples if prefixes is None or s.series.startswith(tuple(prefixes))}


def scrape_metrics(metrics_url: str, prefixes=("prefillonly_", "nv_inference_")) -> dict[str, float]:
    """Triton's Prometheus endpoint as {'name{labels}': value} for the series starting with
    `prefixes` (None: every series). Retries briefly: the metrics port may open a moment after
    /v2/health/ready answers."""
    return by_series(scrape(metrics_url, timeout_s=30, attempts=50), prefixes)
