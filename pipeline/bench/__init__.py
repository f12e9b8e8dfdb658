"""Benchmarks, one module per ``specray bench …`` (and ``specray profile``): each measures side by
side in one run, writes JSON (common.py) and prints a table.

    capture   capture.py   capture tokens/s against the plain forward, bytes/token
    train     train.py     training step time split and tokens/s
    serve     serve.py     ours (AR, a drafter) against transformers and vLLM
    load      load.py      streaming clients on Serve replicas through hot-loads and faults
    step      step.py      where one target forward's time goes
    fidelity  fidelity.py  teacher-forced accuracy against served acceptance
    profile   profile.py   the round-cost table of this machine
"""
