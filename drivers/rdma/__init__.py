"""RDMA HCAs (InfiniBand, RoCE, iWARP) served to containers as their verbs/MAD/CM char devices.

Exclusive mode gives one HCA per device id; shared mode gives every selected HCA to each of N
ids, the way the RDMA shared device plugin lets many pods share a fabric port.
"""
