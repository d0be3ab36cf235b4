"""Trainyard scheduler: gang placement of jobs onto GPU nodes, backed by etcd."""
