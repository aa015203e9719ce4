"""Parallelism applied from outside the model: process groups and meshes, FSDP2, expert parallelism (dispatcher,
all-to-all bytes), meta-device init, activation checkpointing, distributed Muon's placement. Imports model, optim.
"""
