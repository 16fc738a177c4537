"""`make plan`: parameters, FLOPs, memory per GPU and time to budget, without a GPU (docs/planner.md).

* estimate.py - the plan of one recipe; memory.py - memory per GPU; moe.py - MoE terms.
* hardware.py - accelerator and network tables; perf.py - the step-time model.
* search.py - `SEARCH=1`: every layout ranked; published.py - the published layouts it is checked on.
"""
