"""kvpolicy at run time, without vLLM or torch: what every rank of an instance computes alike, written
against declared ports (a collective, a store) that the vLLM adapter and the simulation provide.

The start of issue 24's vLLM-free runtime: so far the striped-load schedule
(:mod:`kvpolicy.runtime.striping`) and the point-to-point exchange it runs over
(:mod:`kvpolicy.runtime.collective`). The architecture test keeps this package free of vLLM, torch
and Mooncake.
"""
