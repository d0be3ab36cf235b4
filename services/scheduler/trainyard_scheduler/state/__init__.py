"""Durable state of the scheduler in etcd: key layout, record codec, repository."""
