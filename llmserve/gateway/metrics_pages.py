"""Several Prometheus text pages as one: the engine metrics of the Triton chat models, which
the gateway's /metrics passes on. Each family is written once (its HELP and TYPE), with the
samples of every page; pages that do not parse are left out."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class _Families(Collector):
    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def merged_pages(pages: Iterable[str]) -> bytes:
    """One text page holding the families of all `pages` (b"" when there are none)."""
    families: dict[str, object] = {}
    for page in pages:
        try:
            parsed = list(text_string_to_metric_families(page))
        except ValueError:  # a page cut short: skipped, the next scrape brings a whole one
            continue
        for family in parsed:
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    if not families:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
