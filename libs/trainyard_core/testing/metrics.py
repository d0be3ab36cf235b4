"""A service's /metrics as tests read it: fetched over HTTP, parsed with Prometheus' own text parser (so a line
the parser refuses fails the test), and looked up by sample name and labels."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape, and each family's type by name."""

    samples: tuple[Sample, ...]
    types: Mapping[str, str]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples: list[Sample] = []
        types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            samples.extend(family.samples)
        return cls(tuple(samples), types)

    def matching(self, name: str, **labels: str) -> list[Sample]:
        """The samples called `name` whose labels include `labels`."""
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the one sample called `name` with exactly `labels` (None: no such sample)."""
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else None

    def total(self, name: str, **labels: str) -> float:
        """The sum over the samples `matching` (0 when there are none)."""
        return sum(s.value for s in self.matching(name, **labels))

    def label_values(self, name: str, label: str) -> set[str]:
        return {s.labels[label] for s in self.samples if s.name == name and label in s.labels}


async def scrape(host: str, port: int) -> Scrape:
    """GET http://host:port/metrics and parse it."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        reply = await client.get(f"http://{host}:{port}/metrics")
    reply.raise_for_status()
    return Scrape.parse(reply.text)
