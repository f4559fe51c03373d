"""One read of a service's Prometheus /metrics, as the metrics tests compare them."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str, accept: str = "") -> dict[tuple, float]:
    """(name, sorted labels) -> value, from one GET of http://address/metrics (with
    the given Accept header, if any)."""
    request = urllib.request.Request(f"http://{address}/metrics",
                                     headers={"Accept": accept} if accept else {})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, str(x)) in ls for k, x in labels.items()))
