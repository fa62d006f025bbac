"""Processes and devices: the process group, rendezvous rounds, DeepSpeed's prebuilt ops."""
